// The numeric recipe of a build: the dtypes activations, weights and gradients live in, and
// the GEMM format each linear layer computes in, by the role of its weight. Resolved once
// (train.precision and the device), held by BuildContext and read by each LinearLayer when
// it is declared: modules never test a dtype to pick a GEMM.
#pragma once

#include "core/dtype.h"
#include "nn/param_role.h"

#include <string>
#include <string_view>

namespace kiln {

// How a linear layer's GEMMs run: ops::linear in the weight's own dtype, or an FP8 format
// (ops/fp8) with its own scratch and GEMM.
enum class GemmFormat {
  f64,   // the tests' fp64 models
  f32,
  bf16,  // bf16 operands, f32 accumulation (the GPU's mixed path)
  // x and W per tensor in e4m3, dy in e5m2 (current scaling), products summed in fp32
  // (ops/fp8/fp8_linear.h: the CPU emulation or the GPU's cuBLASLt FP8 GEMMs).
  fp8_tensorwise,
  // DeepSeek-V3's blockwise scaling: every operand e4m3, activations and gradients in 1 x
  // 128 tiles, weights in 128 x 128 blocks (ops/fp8/fp8_blockwise_linear.h).
  fp8_blockwise,
};

// Whether a format's GEMMs run in FP8 (with operand copies at the workspace's gemm level).
inline bool is_fp8(GemmFormat format) {
  return format == GemmFormat::fp8_tensorwise || format == GemmFormat::fp8_blockwise;
}

std::string_view gemm_format_name(GemmFormat format);

struct PrecisionRecipe {
  // What GEMMs and attention read: activations and the weights modules hold (bf16 on the
  // GPU's mixed path).
  DType compute = DType::f32;
  // Parameters, gradients, the residual stream and statistics: f32 on the mixed path,
  // otherwise the same as compute.
  DType master = DType::f32;
  // The GEMM format of each role's linear layers. Per-role exceptions (an FP8 recipe
  // keeping the LM head and router in bf16) are set here, nowhere else.
  GemmFormat dense = GemmFormat::f32;   // attention, MLP and shared-expert projections
  GemmFormat expert = GemmFormat::f32;  // routed experts
  GemmFormat lm_head = GemmFormat::f32;
  GemmFormat router = GemmFormat::f32;
  // An FP8 projection keeps x's FP8 operand from forward to backward where its module
  // allows (LinearLayer::keep_fp8_input; train.fp8_keep_inputs).
  bool keep_fp8_inputs = true;
  // fp8_blockwise on the GPU: the quantize's vector kernels (train.fp8_blockwise_kernels =
  // "vector", the default; cuda::fp8_quantize_blockwise), else the scalar ones (same bits).
  bool blockwise_vector_kernels = true;
  // The transformer blocks whose dense projections take the dense role's FP8 format (a
  // layer set, config/layer_pattern.h; train.fp8_layers): the others compute in the
  // device's own format, as the first and last blocks are often kept. MTP's blocks follow
  // the recipe as it is.
  std::string fp8_layers = "all";

  // Every role computes in `compute`; masters are f32 under bf16, else `compute` itself.
  static PrecisionRecipe uniform(DType compute);

  bool mixed() const { return compute != master; }
  // For logs: "fp32", "bf16 mixed", "bf16 mixed, fp8_tensorwise GEMMs" (the dense role's
  // format when it differs from the compute dtype's).
  std::string describe() const;
  // The format of a weight of this role (embedding: the LM head's; norms and biases are
  // not GEMM weights and take the dense format).
  GemmFormat format(ParamRole role) const;
  // This recipe for block `layer` of `layers`: the dense role out of FP8 when fp8_layers
  // leaves the block out.
  PrecisionRecipe for_block(int64_t layer, int64_t layers) const;
};

// train.precision on that device: "auto" | "fp32" | "bf16" | "fp8_tensorwise" |
// "fp8_blockwise" (the dense role's GEMMs in that FP8 format, the rest f32 on the CPU and
// bf16 mixed on the GPU). fp16, not built yet, is refused by name.
PrecisionRecipe resolve_precision_recipe(const std::string& setting, Device device);

}  // namespace kiln

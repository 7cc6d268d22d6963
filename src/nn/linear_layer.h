// A linear layer y = x W^T (+ b) as a module declares it: its weight (one parameter, or the
// row blocks of a fused weight as several), its optional bias, their gradients, and the GEMM
// format the build's precision recipe gives its role. Modules call forward/backward instead
// of ops::linear_* so the GEMM's format is decided here, once, at build time.
//
// f64, f32 and bf16 are ops::linear in the weight's own dtype. fp8_tensorwise is
// ops/fp8/fp8_linear.h (per-tensor e4m3 x and W, e5m2 dy: the CPU emulation's bits, or the
// GPU's quantize kernels and cuBLASLt FP8 GEMMs); its operand copies live in the
// workspace's gemm level, planned in declare().
#pragma once

#include "core/exec_context.h"
#include "core/tensor.h"
#include "nn/parameter.h"

#include <utility>
#include <vector>

namespace kiln {

class LinearLayer {
 public:
  LinearLayer() = default;

  // Reserves the weight [out, in] (and its gradient when training) as one parameter, as
  // BuildContext::parameter does.
  void declare(BuildContext& ctx, ParamName name, int64_t out, int64_t in, ParamRole role, Init init);
  // Reserves a fused weight [sum(rows), in] whose row blocks are separate parameters (q|k|v,
  // gate|up), as BuildContext::fused_parameter does; returns its master.
  const Tensor& declare_fused(BuildContext& ctx, const std::vector<std::pair<ParamName, int64_t>>& parts, int64_t in,
                              ParamRole role, Init init);
  // An optional bias [out] (or fused [sum(rows)]), in its own role and init. Declared after
  // the weight.
  void declare_bias(BuildContext& ctx, ParamName name, ParamRole role, Init init);
  void declare_fused_bias(BuildContext& ctx, const std::vector<std::pair<ParamName, int64_t>>& parts, ParamRole role,
                          Init init);

  // x [N, in] -> y [N, out] (written with =). The decode path passes its own context.
  void forward(const Tensor& x, const Tensor& y) const { forward(*exec_, x, y); }
  void forward(const ExecContext& exec, const Tensor& x, const Tensor& y) const;
  // dx [N, in] (= or += when accumulate_dx; skipped if undefined) and, when training, the
  // weight's and bias's gradients (+=).
  void backward(const Tensor& x, const Tensor& dy, const Tensor& dx, bool accumulate_dx = false) const;
  // The two halves of backward, for modules that need x's place for something else between
  // them: dx only, then the weight's (and bias's) gradient only.
  void backward_input(const Tensor& dy, const Tensor& dx, bool accumulate_dx = false) const;
  void backward_weight(const Tensor& x, const Tensor& dy) const;

  // The layer of rows [begin, end) of this one's outputs (a view sharing its weight, bias,
  // gradients and format): mla's k and v rows of one kv_b weight.
  LinearLayer rows(int64_t begin, int64_t end) const;

  // The weight modules compute with ([out, in]; the bf16 copy on the mixed path): fused
  // decode kernels, QK-Clip and exports read it.
  const Tensor& weight() const { return w_; }
  const Tensor& weight_grad() const { return g_; }
  const Tensor& bias() const { return b_; }
  const Tensor& bias_grad() const { return bg_; }
  GemmFormat format() const { return format_; }
  int64_t in_features() const { return w_.size(1); }
  int64_t out_features() const { return w_.size(0); }

 private:
  void bind(const BuildContext& ctx, ParamRole role);
  // An FP8 format's operand copies at the workspace's gemm level, for max_tokens rows.
  void plan_fp8_scratch(BuildContext& ctx) const;

  const ExecContext* exec_ = nullptr;
  Workspace* workspace_ = nullptr;
  GemmFormat format_ = GemmFormat::f32;
  Tensor w_, g_;   // [out, in]
  Tensor b_, bg_;  // [out] or undefined
};

}  // namespace kiln

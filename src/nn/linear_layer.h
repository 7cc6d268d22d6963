// A linear layer y = x W^T (+ b) as a module declares it: its weight (one parameter, or the
// row blocks of a fused weight as several), its optional bias, their gradients, and the GEMM
// format the build's precision recipe gives its role. Modules call forward/backward instead
// of ops::linear_* so the GEMM's format is decided here, once, at build time.
//
// f64, f32 and bf16 are ops::linear in the weight's own dtype. fp8_tensorwise is
// ops/fp8/fp8_linear.h (per-tensor e4m3 x and W, e5m2 dy: the CPU emulation's bits, or the
// GPU's quantize kernels and cuBLASLt FP8 GEMMs), fp8_blockwise
// ops/fp8/fp8_blockwise_linear.h (DeepSeek-V3's 1 x 128 tiles and 128 x 128 blocks); their
// operand copies live in the workspace's gemm level, planned in declare(). A module whose
// backward gets the same x its forward did may ask an fp8_tensorwise layer to keep x's FP8
// operand from forward to backward (keep_fp8_input), so x is quantized once per micro-batch.
#pragma once

#include "core/exec_context.h"
#include "core/tensor.h"
#include "nn/parameter.h"
#include "ops/fp8/fp8_linear.h"

#include <utility>
#include <vector>

namespace kiln {

class WeightGradDeferral;

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

  // When training in an FP8 format: the training forward (the two-argument one) keeps x's
  // weight-gradient operand as one micro-batch's state (BuildContext::saved_buffer), and
  // backward and backward_weight read it instead of x. Only for modules whose backward is
  // given the x (the same values) this micro-batch's forward was, with no other training
  // forward of this layer between them. Otherwise, in another format, or with the recipe's
  // keep_fp8_inputs off, nothing changes.
  void keep_fp8_input(BuildContext& ctx);

  // Whether the weight gradient of a `rows`-row call reads x: not when x's FP8 operand is
  // kept from the forward (and the call runs FP8), so x's memory may serve as scratch.
  bool weight_grad_reads_x(int64_t rows) const;

  // Whether forward's x_amax and backward's dy_amax are read (an FP8 format's quantize
  // takes its scale from them): a module whose op producing x or dy computes max |value| on
  // the way (ops::swiglu_*) passes it, and the quantize skips its own pass over the tensor.
  bool takes_amax() const { return format_ == GemmFormat::fp8_tensorwise; }
  // Where a producer leaves max |x| for this layer (f32 [1] from `scope`) when it takes one;
  // else undefined.
  Tensor amax_slot(Workspace::Scope& scope) const {
    return takes_amax() ? scope.take(DType::f32, Shape{1}) : Tensor();
  }

  // x [N, in] -> y [N, out] (written with =): the training forward. The decode path passes
  // its own context and keeps nothing. x_amax: max |x| (f32 [1]) or undefined.
  void forward(const Tensor& x, const Tensor& y, const Tensor& x_amax = Tensor()) const;
  void forward(const ExecContext& exec, const Tensor& x, const Tensor& y) const;
  // dx [N, in] (= or += when accumulate_dx; skipped if undefined) and, when training, the
  // weight's and bias's gradients (+=). dy_amax: max |dy| (f32 [1]) or undefined.
  void backward(const Tensor& x, const Tensor& dy, const Tensor& dx, bool accumulate_dx = false,
                const Tensor& dy_amax = Tensor()) const;
  // The two halves of backward, for modules that need x's place for something else between
  // them: dx only, then the weight's (and bias's) gradient only.
  void backward_input(const Tensor& dy, const Tensor& dx, bool accumulate_dx = false) const;
  void backward_weight(const Tensor& x, const Tensor& dy) const;
  // While the model's WeightGradDeferral (nn/weight_grad_deferral.h) records, backward and
  // backward_weight leave the weight's and bias's gradients to it (ZB-H1's W pass), which
  // adds them later through weight_grad: backward_weight's arithmetic, never deferred.
  void weight_grad(const Tensor& x, const Tensor& dy) const;

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

  // The GEMMs in this layer's format: the forward, and the backward (x undefined: dx only).
  void gemm_forward(const ExecContext& exec, const Tensor& x, const Tensor& y, const ops::fp8::Fp8KeptInput* keep,
                    const Tensor& x_amax) const;
  void gemm_backward(const Tensor& x, const Tensor& dy, const Tensor& dx, bool accumulate_dx, const Tensor& dw,
                     const Tensor& dbias, const Tensor& dy_amax) const;

  // Whether this call's weight gradient goes to the deferral instead of being added now.
  bool deferring() const;

  const ExecContext* exec_ = nullptr;
  Workspace* workspace_ = nullptr;
  WeightGradDeferral* deferral_ = nullptr;  // the model's (BuildContext::deferral), or null
  // The kept input's buffers (undefined unless keep_fp8_input reserved them), or null.
  const ops::fp8::Fp8KeptInput* kept() const { return kept_.codes.defined() ? &kept_ : nullptr; }

  GemmFormat format_ = GemmFormat::f32;
  bool blockwise_vector_kernels_ = false;  // the recipe's (PrecisionRecipe::blockwise_vector_kernels)
  ops::fp8::Fp8KeptInput kept_;
  Tensor w_, g_;   // [out, in]
  Tensor b_, bg_;  // [out] or undefined
};

}  // namespace kiln

#include "nn/linear_layer.h"

#include "core/error.h"
#include "nn/weight_grad_deferral.h"
#include "ops/fp8/fp8_blockwise_linear.h"
#include "ops/fp8/fp8_linear.h"
#include "ops/linear/linear.h"

namespace kiln {

void LinearLayer::bind(const BuildContext& ctx, ParamRole role) {
  exec_ = &ctx.exec;
  workspace_ = &ctx.workspace;
  deferral_ = ctx.deferral;
  format_ = ctx.precision.format(role);
  blockwise_vector_kernels_ = ctx.precision.blockwise_vector_kernels;
}

void LinearLayer::plan_fp8_scratch(BuildContext& ctx) const {
  if (!is_fp8(format_)) return;
  const DType expected = ctx.device == Device::cpu ? DType::f32 : DType::bf16;
  KILN_CHECK(ctx.dtype == expected, "train.precision", "{} computes in {} on the {}, not {}",
             gemm_format_name(format_), dtype_name(expected), device_name(ctx.device), dtype_name(ctx.dtype));
  const int64_t in = w_.size(1), out = w_.size(0);
  const size_t bytes =
      format_ == GemmFormat::fp8_tensorwise
          ? ops::fp8::fp8_linear_scratch_bytes(ctx.device, ctx.max_tokens, in, out, ctx.training)
          : ops::fp8::fp8_blockwise_linear_scratch_bytes(ctx.device, ctx.max_tokens, in, out, ctx.training);
  ctx.workspace.reserve_peak(bytes, Workspace::Level::gemm);
}

void LinearLayer::declare(BuildContext& ctx, ParamName name, int64_t out, int64_t in, ParamRole role, Init init) {
  bind(ctx, role);
  ctx.parameter(w_, g_, std::move(name), Shape{out, in}, role, init);
  plan_fp8_scratch(ctx);
}

const Tensor& LinearLayer::declare_fused(BuildContext& ctx, const std::vector<std::pair<ParamName, int64_t>>& parts,
                                         int64_t in, ParamRole role, Init init) {
  bind(ctx, role);
  const Tensor& master = ctx.fused_parameter(w_, g_, parts, in, role, init);
  plan_fp8_scratch(ctx);
  return master;
}

void LinearLayer::keep_fp8_input(BuildContext& ctx) {
  if (format_ != GemmFormat::fp8_tensorwise || !ctx.training || !ctx.precision.keep_fp8_inputs) return;
  ctx.saved_buffer(kept_.codes, Shape{ops::fp8::fp8_kept_input_elements(ctx.max_tokens, w_.size(1))},
                   ops::fp8::fp8_kept_input_dtype(ctx.device));
  ctx.saved_buffer(kept_.scales, Shape{2}, DType::f32);
}

bool LinearLayer::weight_grad_reads_x(int64_t rows) const {
  return kept() == nullptr || !ops::fp8::fp8_linear_runs_fp8(w_.device(), rows, w_.size(1), w_.size(0));
}

void LinearLayer::declare_bias(BuildContext& ctx, ParamName name, ParamRole role, Init init) {
  ctx.parameter(b_, bg_, std::move(name), Shape{w_.size(0)}, role, init);
}

void LinearLayer::declare_fused_bias(BuildContext& ctx, const std::vector<std::pair<ParamName, int64_t>>& parts,
                                     ParamRole role, Init init) {
  ctx.fused_parameter(b_, bg_, parts, 0, role, init);
}

// f64, f32 and bf16 are ops::linear in the weight's dtype (bf16 operands with f32
// accumulation); fp8_tensorwise is ops/fp8/fp8_linear.h, fp8_blockwise
// ops/fp8/fp8_blockwise_linear.h. The one place a call picks its GEMM by the format.
void LinearLayer::gemm_forward(const ExecContext& exec, const Tensor& x, const Tensor& y,
                               const ops::fp8::Fp8KeptInput* keep, const Tensor& x_amax) const {
  switch (format_) {
    case GemmFormat::fp8_tensorwise:
      return ops::fp8::fp8_linear_forward(exec, *workspace_, x, w_, b_, y, keep, x_amax);
    case GemmFormat::fp8_blockwise:
      return ops::fp8::fp8_blockwise_linear_forward(exec, *workspace_, x, w_, b_, y, blockwise_vector_kernels_);
    default: return ops::linear_forward(exec, x, w_, b_, y);
  }
}

// x undefined: dx only (dx stands in for x's shape in ops::linear).
void LinearLayer::gemm_backward(const Tensor& x, const Tensor& dy, const Tensor& dx, bool accumulate_dx,
                                const Tensor& dw, const Tensor& dbias, const Tensor& dy_amax) const {
  switch (format_) {
    case GemmFormat::fp8_tensorwise:
      return ops::fp8::fp8_linear_backward(*exec_, *workspace_, x, w_, dy, dx, accumulate_dx, dw, dbias,
                                           x.defined() ? kept() : nullptr, dy_amax);
    case GemmFormat::fp8_blockwise:
      return ops::fp8::fp8_blockwise_linear_backward(*exec_, *workspace_, x, w_, dy, dx, accumulate_dx, dw, dbias,
                                                     blockwise_vector_kernels_);
    default: return ops::linear_backward(*exec_, x.defined() ? x : dx, w_, dy, dx, dw, dbias, accumulate_dx);
  }
}

void LinearLayer::forward(const Tensor& x, const Tensor& y, const Tensor& x_amax) const {
  gemm_forward(*exec_, x, y, kept(), x_amax);
}

void LinearLayer::forward(const ExecContext& exec, const Tensor& x, const Tensor& y) const {
  gemm_forward(exec, x, y, nullptr, Tensor());
}

bool LinearLayer::deferring() const { return deferral_ != nullptr && deferral_->recording() && g_.defined(); }

void LinearLayer::backward(const Tensor& x, const Tensor& dy, const Tensor& dx, bool accumulate_dx,
                           const Tensor& dy_amax) const {
  if (deferring()) {
    // The weight gradient's operands copied first (dx may be x's own memory: the gated
    // MLP's activation), then dx as the one call computes it (in FP8, dy quantized with
    // the same amax); the weight gradient is added later from the copies.
    deferral_->record(*this, x, dy);
    if (dx.defined()) gemm_backward(Tensor(), dy, dx, accumulate_dx, Tensor(), Tensor(), dy_amax);
    return;
  }
  gemm_backward(x, dy, dx, accumulate_dx, g_, bg_, dy_amax);
}

void LinearLayer::backward_input(const Tensor& dy, const Tensor& dx, bool accumulate_dx) const {
  gemm_backward(Tensor(), dy, dx, accumulate_dx, Tensor(), Tensor(), Tensor());
}

void LinearLayer::backward_weight(const Tensor& x, const Tensor& dy) const {
  if (deferring()) return deferral_->record(*this, x, dy);
  weight_grad(x, dy);
}

void LinearLayer::weight_grad(const Tensor& x, const Tensor& dy) const {
  gemm_backward(x, dy, Tensor(), false, g_, bg_, Tensor());
}

LinearLayer LinearLayer::rows(int64_t begin, int64_t end) const {
  LinearLayer view = *this;
  view.w_ = w_.rows(begin, end);
  view.g_ = g_.defined() ? g_.rows(begin, end) : Tensor();
  view.b_ = b_.defined() ? b_.rows(begin, end) : Tensor();
  view.bg_ = bg_.defined() ? bg_.rows(begin, end) : Tensor();
  view.kept_ = {};  // a view's forward and backward may see another x than this layer's
  return view;
}

}  // namespace kiln

#include "nn/linear_layer.h"

#include "core/error.h"
#include "nn/weight_grad_deferral.h"
#include "ops/fp8/fp8_linear.h"
#include "ops/linear/linear.h"

namespace kiln {

void LinearLayer::bind(const BuildContext& ctx, ParamRole role) {
  exec_ = &ctx.exec;
  workspace_ = &ctx.workspace;
  deferral_ = ctx.deferral;
  format_ = ctx.precision.format(role);
}

void LinearLayer::plan_fp8_scratch(BuildContext& ctx) const {
  if (format_ != GemmFormat::fp8_tensorwise) return;
  const DType expected = ctx.device == Device::cpu ? DType::f32 : DType::bf16;
  KILN_CHECK(ctx.dtype == expected, "train.precision", "fp8_tensorwise computes in {} on the {}, not {}",
             dtype_name(expected), device_name(ctx.device), dtype_name(ctx.dtype));
  ctx.workspace.reserve_peak(ops::fp8::fp8_linear_scratch_bytes(ctx.device, ctx.max_tokens, w_.size(1), w_.size(0),
                                                                ctx.training),
                             Workspace::Level::gemm);
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
// accumulation); fp8_tensorwise is ops/fp8/fp8_linear.h.
void LinearLayer::forward(const Tensor& x, const Tensor& y, const Tensor& x_amax) const {
  if (format_ == GemmFormat::fp8_tensorwise)
    return ops::fp8::fp8_linear_forward(*exec_, *workspace_, x, w_, b_, y, kept(), x_amax);
  ops::linear_forward(*exec_, x, w_, b_, y);
}

void LinearLayer::forward(const ExecContext& exec, const Tensor& x, const Tensor& y) const {
  if (format_ == GemmFormat::fp8_tensorwise) return ops::fp8::fp8_linear_forward(exec, *workspace_, x, w_, b_, y);
  ops::linear_forward(exec, x, w_, b_, y);
}

bool LinearLayer::deferring() const { return deferral_ != nullptr && deferral_->recording() && g_.defined(); }

void LinearLayer::backward(const Tensor& x, const Tensor& dy, const Tensor& dx, bool accumulate_dx,
                           const Tensor& dy_amax) const {
  if (deferring()) {
    // The weight gradient's operands copied first (dx may be x's own memory: the gated
    // MLP's activation), then dx as the one call computes it (in FP8, dy quantized with
    // the same amax); the weight gradient is added later from the copies.
    deferral_->record(*this, x, dy);
    if (dx.defined()) {
      if (format_ == GemmFormat::fp8_tensorwise)
        ops::fp8::fp8_linear_backward(*exec_, *workspace_, Tensor(), w_, dy, dx, accumulate_dx, Tensor(), Tensor(),
                                      nullptr, dy_amax);
      else
        ops::linear_backward(*exec_, dx, w_, dy, dx, Tensor(), Tensor(), accumulate_dx);
    }
    return;
  }
  if (format_ == GemmFormat::fp8_tensorwise)
    return ops::fp8::fp8_linear_backward(*exec_, *workspace_, x, w_, dy, dx, accumulate_dx, g_, bg_, kept(), dy_amax);
  ops::linear_backward(*exec_, x, w_, dy, dx, g_, bg_, accumulate_dx);
}

// x is read for the weight gradient only: dx stands in for it (same shape).
void LinearLayer::backward_input(const Tensor& dy, const Tensor& dx, bool accumulate_dx) const {
  if (format_ == GemmFormat::fp8_tensorwise)
    return ops::fp8::fp8_linear_backward(*exec_, *workspace_, Tensor(), w_, dy, dx, accumulate_dx, Tensor(), Tensor());
  ops::linear_backward(*exec_, dx, w_, dy, dx, Tensor(), Tensor(), accumulate_dx);
}

void LinearLayer::backward_weight(const Tensor& x, const Tensor& dy) const {
  if (deferring()) return deferral_->record(*this, x, dy);
  weight_grad(x, dy);
}

void LinearLayer::weight_grad(const Tensor& x, const Tensor& dy) const {
  if (format_ == GemmFormat::fp8_tensorwise)
    return ops::fp8::fp8_linear_backward(*exec_, *workspace_, x, w_, dy, Tensor(), false, g_, bg_, kept());
  ops::linear_backward(*exec_, x, w_, dy, Tensor(), g_, bg_);
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

#include "nn/linear_layer.h"

#include "ops/linear/linear.h"

namespace kiln {

void LinearLayer::bind(const BuildContext& ctx, ParamRole role) {
  exec_ = &ctx.exec;
  format_ = ctx.precision.format(role);
}

void LinearLayer::declare(BuildContext& ctx, ParamName name, int64_t out, int64_t in, ParamRole role, Init init) {
  bind(ctx, role);
  ctx.parameter(w_, g_, std::move(name), Shape{out, in}, role, init);
}

const Tensor& LinearLayer::declare_fused(BuildContext& ctx, const std::vector<std::pair<ParamName, int64_t>>& parts,
                                         int64_t in, ParamRole role, Init init) {
  bind(ctx, role);
  return ctx.fused_parameter(w_, g_, parts, in, role, init);
}

void LinearLayer::declare_bias(BuildContext& ctx, ParamName name, ParamRole role, Init init) {
  ctx.parameter(b_, bg_, std::move(name), Shape{w_.size(0)}, role, init);
}

void LinearLayer::declare_fused_bias(BuildContext& ctx, const std::vector<std::pair<ParamName, int64_t>>& parts,
                                     ParamRole role, Init init) {
  ctx.fused_parameter(b_, bg_, parts, 0, role, init);
}

// Every format built today is ops::linear in the weight's dtype (f64, f32, or bf16 operands
// with f32 accumulation); an FP8 format's GEMM is chosen here by format_.
void LinearLayer::forward(const ExecContext& exec, const Tensor& x, const Tensor& y) const {
  ops::linear_forward(exec, x, w_, b_, y);
}

void LinearLayer::backward(const Tensor& x, const Tensor& dy, const Tensor& dx, bool accumulate_dx) const {
  ops::linear_backward(*exec_, x, w_, dy, dx, g_, bg_, accumulate_dx);
}

// x is read for the weight gradient only: dx stands in for it (same shape).
void LinearLayer::backward_input(const Tensor& dy, const Tensor& dx, bool accumulate_dx) const {
  ops::linear_backward(*exec_, dx, w_, dy, dx, Tensor(), Tensor(), accumulate_dx);
}

void LinearLayer::backward_weight(const Tensor& x, const Tensor& dy) const {
  ops::linear_backward(*exec_, x, w_, dy, Tensor(), g_, bg_);
}

LinearLayer LinearLayer::rows(int64_t begin, int64_t end) const {
  LinearLayer view = *this;
  view.w_ = w_.rows(begin, end);
  view.g_ = g_.defined() ? g_.rows(begin, end) : Tensor();
  view.b_ = b_.defined() ? b_.rows(begin, end) : Tensor();
  view.bg_ = bg_.defined() ? bg_.rows(begin, end) : Tensor();
  return view;
}

}  // namespace kiln

#include "nn/linear_layer.h"

#include "core/error.h"
#include "ops/fp8/fp8_linear_cpu.h"
#include "ops/linear/linear.h"

#include <algorithm>

namespace kiln {

void LinearLayer::bind(const BuildContext& ctx, ParamRole role) {
  exec_ = &ctx.exec;
  workspace_ = &ctx.workspace;
  format_ = ctx.precision.format(role);
}

void LinearLayer::plan_fp8_scratch(BuildContext& ctx) const {
  if (format_ != GemmFormat::fp8_tensorwise) return;
  KILN_CHECK(ctx.device == Device::cpu && ctx.dtype == DType::f32, "train.precision",
             "fp8_tensorwise is built for f32 on the CPU only, not {} on {}", dtype_name(ctx.dtype),
             device_name(ctx.device));
  const int64_t t = ctx.max_tokens, in = w_.size(1), out = w_.size(0);
  auto bytes = [](int64_t rows, int64_t cols) { return Workspace::footprint(DType::f32, Shape{rows, cols}); };
  // Forward: x and W^T. Backward: x, dy, W, then dW's and dx's sums.
  const size_t forward = bytes(t, in) + bytes(in, out);
  const size_t backward = bytes(t, in) + bytes(t, out) + bytes(out, in) + bytes(out, in) + bytes(t, in);
  ctx.workspace.reserve_peak(std::max(forward, ctx.training ? backward : 0), Workspace::Level::gemm);
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

void LinearLayer::declare_bias(BuildContext& ctx, ParamName name, ParamRole role, Init init) {
  ctx.parameter(b_, bg_, std::move(name), Shape{w_.size(0)}, role, init);
}

void LinearLayer::declare_fused_bias(BuildContext& ctx, const std::vector<std::pair<ParamName, int64_t>>& parts,
                                     ParamRole role, Init init) {
  ctx.fused_parameter(b_, bg_, parts, 0, role, init);
}

// f64, f32 and bf16 are ops::linear in the weight's dtype (bf16 operands with f32
// accumulation); fp8_tensorwise is the CPU reference below.
void LinearLayer::forward(const ExecContext& exec, const Tensor& x, const Tensor& y) const {
  if (format_ == GemmFormat::fp8_tensorwise) return forward_fp8(x, y);
  ops::linear_forward(exec, x, w_, b_, y);
}

void LinearLayer::backward(const Tensor& x, const Tensor& dy, const Tensor& dx, bool accumulate_dx) const {
  if (format_ == GemmFormat::fp8_tensorwise) return backward_fp8(x, dy, dx, accumulate_dx);
  ops::linear_backward(*exec_, x, w_, dy, dx, g_, bg_, accumulate_dx);
}

// x is read for the weight gradient only: dx stands in for it (same shape).
void LinearLayer::backward_input(const Tensor& dy, const Tensor& dx, bool accumulate_dx) const {
  if (format_ == GemmFormat::fp8_tensorwise) return backward_fp8(Tensor(), dy, dx, accumulate_dx);
  ops::linear_backward(*exec_, dx, w_, dy, dx, Tensor(), Tensor(), accumulate_dx);
}

void LinearLayer::backward_weight(const Tensor& x, const Tensor& dy) const {
  if (format_ == GemmFormat::fp8_tensorwise) return backward_fp8(x, dy, Tensor(), false);
  ops::linear_backward(*exec_, x, w_, dy, Tensor(), g_, bg_);
}

namespace {

void expect_f32_rows(const char* what, const Tensor& t, int64_t cols) {
  KILN_CHECK(t.device() == Device::cpu && t.dtype() == DType::f32 && t.rank() == 2 && t.size(1) == cols,
             "fp8_tensorwise", "{} must be f32 [N, {}] on the CPU, got {}", what, cols, t.describe());
}

}  // namespace

void LinearLayer::forward_fp8(const Tensor& x, const Tensor& y) const {
  using ops::fp8::Format;
  const int64_t n = x.size(0), in = in_features(), out = out_features();
  expect_f32_rows("x", x, in), expect_f32_rows("y", y, out);
  KILN_CHECK(y.size(0) == n, "fp8_tensorwise", "y has {} rows for {} rows of x", y.size(0), n);
  Workspace::Scope scope(*workspace_);
  const Tensor xq = scope.take(DType::f32, Shape{n, in}), wt = scope.take(DType::f32, Shape{in, out});
  ops::fp8::quantize_dequantize_tensorwise(x.data<float>(), n, in, Format::e4m3, xq.data<float>(), false, "x");
  ops::fp8::quantize_dequantize_tensorwise(w_.data<float>(), out, in, Format::e4m3, wt.data<float>(), true, "W");
  // y [n, out]: y_ij = sum_p x_ip W_jp, B = W^T [in, out].
  ops::fp8::gemm_rounded(n, out, in, xq.data<float>(), in, 1, wt.data<float>(), y.data<float>(), false, nullptr);
  if (b_.defined()) {
    const float* bias = b_.data<float>();
    float* yp = y.data<float>();
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < out; ++j) yp[i * out + j] += bias[j];
  }
}

void LinearLayer::backward_fp8(const Tensor& x, const Tensor& dy, const Tensor& dx, bool accumulate_dx) const {
  using ops::fp8::Format;
  const int64_t n = dy.size(0), in = in_features(), out = out_features();
  expect_f32_rows("dy", dy, out);
  const bool weight = x.defined() && g_.defined();
  Workspace::Scope scope(*workspace_);
  // Every operand is quantized before anything is written: dx may be x's place.
  const Tensor dyq = scope.take(DType::f32, Shape{n, out}), wq = scope.take(DType::f32, Shape{out, in});
  ops::fp8::quantize_dequantize_tensorwise(dy.data<float>(), n, out, Format::e5m2, dyq.data<float>(), false, "dy");
  Tensor xq;
  if (weight) {
    expect_f32_rows("x", x, in);
    xq = scope.take(DType::f32, Shape{n, in});
    ops::fp8::quantize_dequantize_tensorwise(x.data<float>(), n, in, Format::e4m3, xq.data<float>(), false, "x");
  }
  if (dx.defined()) {
    expect_f32_rows("dx", dx, in);
    ops::fp8::quantize_dequantize_tensorwise(w_.data<float>(), out, in, Format::e4m3, wq.data<float>(), false, "W");
    // dx [n, in] = dy [n, out] W [out, in].
    const Tensor sums = accumulate_dx ? scope.take(DType::f32, Shape{n, in}) : Tensor();
    ops::fp8::gemm_rounded(n, in, out, dyq.data<float>(), out, 1, wq.data<float>(), dx.data<float>(), accumulate_dx,
                           sums.data_or_null<float>());
  }
  if (weight) {
    // dW [out, in] += dy^T [out, n] x [n, in]: A read down dy's columns.
    const Tensor sums = scope.take(DType::f32, Shape{out, in});
    ops::fp8::gemm_rounded(out, in, n, dyq.data<float>(), 1, out, xq.data<float>(), g_.data<float>(), true,
                           sums.data<float>());
    // The bias's gradient from the unquantized dy, as the f32 path sums it.
    if (bg_.defined()) ops::linear_backward(*exec_, x, w_, dy, Tensor(), Tensor(), bg_);
  }
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

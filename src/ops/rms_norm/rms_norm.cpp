#include "ops/rms_norm/rms_norm.h"

#include "core/op_profiler.h"
#include "ops/common.h"
#include "ops/rms_norm/rms_norm_cpu.h"
#include "ops/rms_norm/rms_norm_cuda.h"
#include "ops/elementwise/elementwise.h"

namespace kiln::ops {

namespace {
// The mixed path (bf16 output y / gradient dy on the GPU): x is fp32 (the residual
// stream) or bf16 (per-head q/k), the gain, rstd and dw fp32, dx has x's dtype.
void validate(const char* op, const Tensor& x, const Tensor& w, const Tensor& rstd, bool mixed) {
  expect_rank(op, "x", x, 2);
  const DType stats = mixed ? DType::f32 : x.dtype();
  if (w.defined()) expect_tensor(op, "w", w, Shape{x.size(1)}, stats, x.device());
  expect_tensor(op, "rstd", rstd, Shape{x.size(0)}, stats, x.device());
  if (mixed)
    KILN_CHECK(x.dtype() == DType::f32 || x.dtype() == DType::bf16, op, "x must be f32 or bf16, got {}",
               x.describe());
}
}  // namespace

void rms_norm_forward(const ExecContext& ctx, const Tensor& x, const Tensor& w, double eps, const Tensor& y, const Tensor& rstd) {
  const char* op = "rms_norm";
  KILN_OP_SCOPE(op, x);
  const bool mixed = is_mixed(y);
  validate(op, x, w, rstd, mixed);
  expect_tensor(op, "y", y, x.shape(), mixed ? DType::bf16 : x.dtype(), x.device());
  KILN_CHECK(eps > 0, op, "eps must be positive, got {}", eps);
  if (x.device() == Device::cuda) {
#if KILN_WITH_CUDA
    if (mixed) {
      cuda::rms_norm_forward_mixed(ctx, x.raw(), x.dtype(), w.defined() ? w.data<float>() : nullptr,
                                   static_cast<float>(eps), x.size(0), x.size(1), bf16_data(y), rstd.data<float>());
      return;
    }
    expect_dtype(op, "x", x, DType::f32);
    cuda::rms_norm_forward_f32(ctx, x.data<float>(), w.defined() ? w.data<float>() : nullptr, static_cast<float>(eps),
                               x.size(0), x.size(1), y.data<float>(), rstd.data<float>());
    return;
#else
    no_cuda_kernel(op);
#endif
  }
  dispatch_cpu_float(op, x.dtype(), [&](auto zero) {
    using T = decltype(zero);
    cpu::rms_norm_forward<T>(x.data<T>(), w.defined() ? w.data<T>() : nullptr, eps, x.size(0), x.size(1),
                             y.data<T>(), rstd.data<T>());
  });
}

void add_rms_norm_forward(const ExecContext& ctx, const Tensor& a, const Tensor& b, const Tensor& w, double eps, const Tensor& sum,
                          const Tensor& y, const Tensor& rstd) {
  const char* op = "add_rms_norm";
  const bool fused = is_mixed(y) && a.dtype() == DType::f32 && b.dtype() == DType::bf16;
  if (!fused) {
    add(ctx, a, b, sum);
    rms_norm_forward(ctx, sum, w, eps, y, rstd);
    return;
  }
  KILN_OP_SCOPE(op, a);
  validate(op, a, w, rstd, true);
  expect_tensor(op, "b", b, a.shape(), DType::bf16, a.device());
  expect_tensor(op, "sum", sum, a.shape(), DType::f32, a.device());
  expect_tensor(op, "y", y, a.shape(), DType::bf16, a.device());
  KILN_CHECK(sum.raw() != a.raw() && sum.raw() != b.raw(), op, "sum must not alias a or b");
  KILN_CHECK(eps > 0, op, "eps must be positive, got {}", eps);
#if KILN_WITH_CUDA
  cuda::rms_norm_forward_mixed(ctx, a.raw(), DType::f32, w.defined() ? w.data<float>() : nullptr, static_cast<float>(eps),
                               a.size(0), a.size(1), bf16_data(y), rstd.data<float>(), bf16_data(b),
                               sum.data<float>());
#else
  no_cuda_kernel(op);
#endif
}

void rms_norm_backward(const ExecContext& ctx, const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy, const Tensor& dx,
                       const Tensor& dw, bool accumulate_dx, const Tensor& dx_copy) {
  const char* op = "rms_norm_backward";
  KILN_OP_SCOPE(op, x);
  const bool mixed = is_mixed(dy);
  validate(op, x, w, rstd, mixed);
  expect_tensor(op, "dy", dy, x.shape(), mixed ? DType::bf16 : x.dtype(), x.device());
  expect_tensor(op, "dx", dx, x.shape(), x.dtype(), x.device());
  KILN_CHECK(!dw.defined() || w.defined(), op, "dw given for a norm without gain");
  if (dw.defined()) expect_tensor(op, "dw", dw, w.shape(), w.dtype(), w.device());
  // The mixed path writes the copy in the same pass, so it must be bf16 there; elsewhere
  // the copy is a conversion after the backward.
  if (dx_copy.defined())
    expect_tensor(op, "dx_copy", dx_copy, x.shape(), mixed ? DType::bf16 : dx_copy.dtype(), x.device());
  if (x.device() == Device::cuda) {
#if KILN_WITH_CUDA
    if (mixed) {
      cuda::rms_norm_backward_mixed(ctx, x.raw(), x.dtype(), w.defined() ? w.data<float>() : nullptr, rstd.data<float>(),
                                    bf16_data(dy), x.size(0), x.size(1), dx.raw(), accumulate_dx,
                                    dw.defined() ? dw.data<float>() : nullptr,
                                    dx_copy.defined() ? bf16_data(dx_copy) : nullptr);
      return;
    }
    expect_dtype(op, "x", x, DType::f32);
    cuda::rms_norm_backward_f32(ctx, x.data<float>(), w.defined() ? w.data<float>() : nullptr, rstd.data<float>(),
                                dy.data<float>(), x.size(0), x.size(1), dx.data<float>(),
                                dw.defined() ? dw.data<float>() : nullptr, accumulate_dx);
    if (dx_copy.defined()) convert(ctx, dx, dx_copy);
    return;
#else
    no_cuda_kernel(op);
#endif
  }
  dispatch_cpu_float(op, x.dtype(), [&](auto zero) {
    using T = decltype(zero);
    cpu::rms_norm_backward<T>(x.data<T>(), w.defined() ? w.data<T>() : nullptr, rstd.data<T>(), dy.data<T>(),
                              x.size(0), x.size(1), dx.data<T>(), dw.defined() ? dw.data<T>() : nullptr,
                              accumulate_dx);
  });
  if (dx_copy.defined()) convert(ctx, dx, dx_copy);
}

}  // namespace kiln::ops

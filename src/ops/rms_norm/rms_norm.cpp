#include "ops/rms_norm/rms_norm.h"

#include "core/op_profiler.h"
#include "ops/common.h"
#include "ops/rms_norm/rms_norm_kernels.h"

namespace kiln::ops {

namespace {
void validate(const char* op, const Tensor& x, const Tensor& w, const Tensor& rstd) {
  expect_rank(op, "x", x, 2);
  if (w.defined()) expect_shape(op, "w", w, Shape{x.size(1)}), expect_same(op, "w", w, x);
  expect_shape(op, "rstd", rstd, Shape{x.size(0)});
  expect_same(op, "rstd", rstd, x);
}
}  // namespace

void rms_norm_forward(const Tensor& x, const Tensor& w, double eps, const Tensor& y, const Tensor& rstd) {
  const char* op = "rms_norm";
  KILN_OP_SCOPE(op, x);
  validate(op, x, w, rstd);
  expect_shape(op, "y", y, x.shape());
  expect_same(op, "y", y, x);
  KILN_CHECK(eps > 0, op, "eps must be positive, got {}", eps);
  if (x.device() == Device::cuda) {
#if KILN_WITH_CUDA
    expect_dtype(op, "x", x, DType::f32);
    cuda::rms_norm_forward_f32(x.data<float>(), w.defined() ? w.data<float>() : nullptr, static_cast<float>(eps),
                               x.size(0), x.size(1), y.data<float>(), rstd.data<float>(), nullptr);
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

void rms_norm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy, const Tensor& dx,
                       const Tensor& dw, bool accumulate_dx) {
  const char* op = "rms_norm_backward";
  KILN_OP_SCOPE(op, x);
  validate(op, x, w, rstd);
  expect_shape(op, "dy", dy, x.shape());
  expect_same(op, "dy", dy, x);
  expect_shape(op, "dx", dx, x.shape());
  expect_same(op, "dx", dx, x);
  KILN_CHECK(!dw.defined() || w.defined(), op, "dw given for a norm without gain");
  if (dw.defined()) expect_shape(op, "dw", dw, w.shape()), expect_same(op, "dw", dw, x);
  if (x.device() == Device::cuda) {
#if KILN_WITH_CUDA
    expect_dtype(op, "x", x, DType::f32);
    cuda::rms_norm_backward_f32(x.data<float>(), w.defined() ? w.data<float>() : nullptr, rstd.data<float>(),
                                dy.data<float>(), x.size(0), x.size(1), dx.data<float>(),
                                dw.defined() ? dw.data<float>() : nullptr, accumulate_dx, nullptr);
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
}

}  // namespace kiln::ops

#include "ops/activation/activation.h"

#include "core/op_profiler.h"
#include "ops/common.h"
#if KILN_WITH_CUDA
#include "ops/activation/activation_cuda.h"
#endif

namespace kiln::ops {

namespace {

void validate(const char* op, const Tensor& x, const Tensor& other, const char* other_name) {
  expect_rank(op, "x", x, 2);
  expect_shape(op, other_name, other, x.shape());
  expect_same(op, other_name, other, x);
  if (x.device() == Device::cuda)
    KILN_CHECK(x.dtype() == DType::f32 || x.dtype() == DType::bf16, op, "x must be f32 or bf16 on the GPU, got {}",
               x.describe());
}

}  // namespace

void activation_forward(const ExecContext& ctx, activation::Kind kind, const Tensor& x, const Tensor& out) {
  const char* op = activation::name(kind);
  KILN_OP_SCOPE(op, x);
  validate(op, x, out, "out");
  KILN_ON_CUDA(x, op, cuda::activation_forward(ctx, kind, x.raw(), x.dtype(), x.numel(), out.raw()));
  dispatch_cpu_float(op, x.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const T* in = x.data<T>();
    T* o = out.data<T>();
    const int64_t count = x.numel();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < count; ++i) o[i] = activation::value(kind, in[i]);
  });
}

void activation_backward(const ExecContext& ctx, activation::Kind kind, const Tensor& x, const Tensor& dout, const Tensor& dx,
                         const Tensor& out) {
  const char* op = kind == activation::Kind::gelu_tanh ? "gelu_tanh_backward" : "relu2_backward";
  KILN_OP_SCOPE(op, x);
  validate(op, x, dout, "dout");
  validate(op, x, dx, "dx");
  if (out.defined()) validate(op, x, out, "out");
  KILN_ON_CUDA(x, op,
               cuda::activation_backward(ctx, kind, x.raw(), dout.raw(), x.dtype(), x.numel(), dx.raw(),
                                         out.defined() ? out.raw() : nullptr));
  dispatch_cpu_float(op, x.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const T* in = x.data<T>();
    const T* d = dout.data<T>();
    T* g = dx.data<T>();
    T* o = out.defined() ? out.data<T>() : nullptr;
    const int64_t count = x.numel();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < count; ++i) {
      const T v = in[i], dy = d[i];
      g[i] = dy * activation::derivative(kind, v);
      if (o) o[i] = activation::value(kind, v);  // after dout is read: out may be dout
    }
  });
}

}  // namespace kiln::ops

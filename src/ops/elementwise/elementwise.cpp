#include "ops/elementwise/elementwise.h"

#include "core/op_profiler.h"
#include "ops/common.h"
#include "ops/elementwise/elementwise_cuda.h"

#include <cmath>

namespace kiln::ops {

void add_inplace(const ExecContext& ctx, const Tensor& dst, const Tensor& src) {
  const char* op = "add_inplace";
  KILN_OP_SCOPE(op, dst);
  expect_same(op, "src", src, dst);
  KILN_CHECK(src.numel() == dst.numel(), op, "size mismatch {} vs {}", dst.describe(), src.describe());
  // bf16 on the GPU's mixed path (the shared expert's output onto the routed experts').
  KILN_ON_CUDA(dst, op,
               dst.dtype() == DType::bf16
                   ? cuda::add_inplace_bf16(ctx, bf16_data(dst), bf16_data(src), dst.numel())
                   : cuda::add_inplace_f32(ctx, dst.data<float>(), src.data<float>(), dst.numel()));
  dispatch_cpu_float(op, dst.dtype(), [&](auto zero) {
    using T = decltype(zero);
    T* d = dst.data<T>();
    const T* s = src.data<T>();
    const int64_t n = dst.numel();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) d[i] += s[i];
  });
}

void zero(const ExecContext& ctx, const Tensor& t) {
  (void)ctx;
  if (t.nbytes() == 0) return;
  KILN_ON_CUDA(t, "zero", cuda::zero_bytes(ctx, t.raw(), t.nbytes()));
  zero_tensor(t);
}

void add(const ExecContext& ctx, const Tensor& a, const Tensor& b, const Tensor& out) {
  const char* op = "add";
  KILN_OP_SCOPE(op, a);
  expect_same(op, "out", out, a);
  if (is_mixed(b))  // fp32 residual + bf16 branch output
    expect_dtype(op, "a", a, DType::f32);
  else
    expect_same(op, "b", b, a);
  KILN_CHECK(a.numel() == b.numel() && a.numel() == out.numel(), op, "size mismatch {} {} {}", a.describe(),
             b.describe(), out.describe());
  KILN_ON_CUDA(a, op, {
    if (is_mixed(b))
      cuda::add_f32_bf16(ctx, a.data<float>(), bf16_data(b), a.numel(), out.data<float>());
    else
      cuda::add_f32(ctx, a.data<float>(), b.data<float>(), a.numel(), out.data<float>());
  });
  dispatch_cpu_float(op, a.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const T* x = a.data<T>();
    const T* y = b.data<T>();
    T* o = out.data<T>();
    const int64_t n = a.numel();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) o[i] = x[i] + y[i];
  });
}

void convert(const ExecContext& ctx, const Tensor& src, const Tensor& dst) {
  const char* op = "convert";
  KILN_OP_SCOPE(op, src);
  KILN_CHECK(src.numel() == dst.numel() && src.device() == dst.device(), op, "cannot convert {} into {}",
             src.describe(), dst.describe());
  if (src.dtype() == dst.dtype()) {
    // On the GPU a copy on the context's stream, ordered with its kernels (and capturable).
#if KILN_WITH_CUDA
    if (src.device() == Device::cuda) {
      cuda::copy_bytes(ctx, src.raw(), static_cast<size_t>(src.numel()) * dtype_size(src.dtype()), dst.raw());
      return;
    }
#endif
    copy_tensor(src, dst);
    return;
  }
  KILN_ON_CUDA(src, op, {
    if (src.dtype() == DType::f32 && dst.dtype() == DType::bf16)
      cuda::cast_f32_to_bf16(ctx, src.data<float>(), src.numel(), bf16_data(dst));
    else if (src.dtype() == DType::bf16 && dst.dtype() == DType::f32)
      cuda::cast_bf16_to_f32(ctx, bf16_data(src), src.numel(), dst.data<float>());
    else
      fail(op, "no GPU conversion from {} to {}", dtype_name(src.dtype()), dtype_name(dst.dtype()));
  });
  fail(op, "no CPU conversion from {} to {}", dtype_name(src.dtype()), dtype_name(dst.dtype()));
}

void sum_squares_to_device(const ExecContext& ctx, const Tensor& x, double* out) {
  const char* op = "sum_squares";
  KILN_OP_SCOPE(op, x);
  KILN_CHECK(x.device() == Device::cuda, op, "the device-memory form needs a GPU tensor, got {}", x.describe());
  expect_dtype(op, "x", x, DType::f32);
#if KILN_WITH_CUDA
  cuda::sum_squares_to_device_f32(ctx, x.data<float>(), x.numel(), out);
#else
  (void)out;
  ops::no_cuda_kernel(op);
#endif
}

double sum_squares(const ExecContext& ctx, const Tensor& x) {
  const char* op = "sum_squares";
  KILN_OP_SCOPE(op, x);
  if (x.device() == Device::cuda) {
#if KILN_WITH_CUDA
    expect_dtype(op, "x", x, DType::f32);
    return cuda::sum_squares_f32(ctx, x.data<float>(), x.numel());
#else
    no_cuda_kernel(op);
#endif
  }
  double total = 0;
  dispatch_cpu_float(op, x.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const T* p = x.data<T>();
    for (int64_t i = 0; i < x.numel(); ++i) total += static_cast<double>(p[i]) * static_cast<double>(p[i]);
  });
  return total;
}

void scale_inplace(const ExecContext& ctx, const Tensor& x, double factor) {
  const char* op = "scale_inplace";
  KILN_OP_SCOPE(op, x);
  KILN_ON_CUDA(x, op, cuda::scale_inplace_f32(ctx, x.data<float>(), x.numel(), static_cast<float>(factor)));
  dispatch_cpu_float(op, x.dtype(), [&](auto zero) {
    using T = decltype(zero);
    T* p = x.data<T>();
    for (int64_t i = 0; i < x.numel(); ++i) p[i] = static_cast<T>(p[i] * factor);
  });
}

bool all_finite(const ExecContext& ctx, const Tensor& x) {
  const char* op = "all_finite";
  KILN_OP_SCOPE(op, x);
  if (x.device() == Device::cuda) {
#if KILN_WITH_CUDA
    expect_dtype(op, "x", x, DType::f32);
    return cuda::all_finite_f32(ctx, x.data<float>(), x.numel());
#else
    no_cuda_kernel(op);
#endif
  }
  bool finite = true;
  dispatch_cpu_float(op, x.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const T* p = x.data<T>();
    for (int64_t i = 0; i < x.numel(); ++i)
      if (!std::isfinite(p[i])) finite = false;
  });
  return finite;
}

}  // namespace kiln::ops

#include "ops/dyt/dyt.h"

#include "core/op_profiler.h"
#include "ops/common.h"
#include "ops/elementwise/elementwise.h"
#if KILN_WITH_CUDA
#include "ops/dyt/dyt_cuda.h"
#endif

#include <cmath>
#include <vector>

namespace kiln::ops {

namespace {

// The parameters' dtype: x's on the CPU (f32 or f64), f32 on the GPU (both paths).
DType param_dtype(const Tensor& x) { return x.device() == Device::cuda ? DType::f32 : x.dtype(); }

// y's (and dy's) dtype: bf16 on the mixed path, else x's.
DType output_dtype(const Tensor& x, bool mixed) { return mixed ? DType::bf16 : x.dtype(); }

void validate(const char* op, const Tensor& x, const Tensor& alpha, const Tensor& w, bool mixed) {
  expect_rank(op, "x", x, 2);
  const DType p = param_dtype(x);
  expect_tensor(op, "alpha", alpha, Shape{1}, p, x.device());
  if (w.defined()) expect_tensor(op, "w", w, Shape{x.size(1)}, p, x.device());
  if (x.device() == Device::cuda)
    KILN_CHECK(x.dtype() == DType::f32 || (mixed && x.dtype() == DType::bf16), op,
               "x must be f32{} on the GPU, got {}", mixed ? " or bf16" : "", x.describe());
}

// The CPU reference, T = float or double; parameter gradients summed in a fixed order
// (rows in turn) in T.
template <typename T>
void forward_cpu(const T* x, T alpha, const T* w, const T* b, int64_t rows, int64_t cols, T* y) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const T t = std::tanh(alpha * x[r * cols + c]);
      y[r * cols + c] = t * (w ? w[c] : T(1)) + (b ? b[c] : T(0));
    }
}

template <typename T>
void backward_cpu(const T* x, T alpha, const T* w, const T* dy, int64_t rows, int64_t cols, T* dx, bool accumulate,
                  T* dalpha, T* dw, T* db) {
  T alpha_sum = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t i = r * cols + c;
      const T t = std::tanh(alpha * x[i]), slope = T(1) - t * t, g = dy[i] * (w ? w[c] : T(1));
      const T d = g * alpha * slope;
      dx[i] = accumulate ? dx[i] + d : d;
      alpha_sum += g * x[i] * slope;
      if (dw) dw[c] += dy[i] * t;
      if (db) db[c] += dy[i];
    }
  if (dalpha) *dalpha += alpha_sum;
}

}  // namespace

void dyt_forward(const ExecContext& ctx, const Tensor& x, const Tensor& alpha, const Tensor& w, const Tensor& b, const Tensor& y) {
  const char* op = "dyt";
  KILN_OP_SCOPE(op, x);
  const bool mixed = is_mixed(y);
  validate(op, x, alpha, w, mixed);
  if (b.defined()) expect_tensor(op, "b", b, Shape{x.size(1)}, param_dtype(x), x.device());
  expect_tensor(op, "y", y, x.shape(), output_dtype(x, mixed), x.device());
  KILN_ON_CUDA(x, op,
               cuda::dyt_forward(ctx, x.raw(), x.dtype(), alpha.data<float>(), w.data_or_null<float>(), b.data_or_null<float>(), x.size(0),
                                 x.size(1), y.raw(), y.dtype()));
  dispatch_cpu_float(op, x.dtype(), [&](auto zero) {
    using T = decltype(zero);
    forward_cpu<T>(x.data<T>(), alpha.data<T>()[0], w.defined() ? w.data<T>() : nullptr,
                   b.defined() ? b.data<T>() : nullptr, x.size(0), x.size(1), y.data<T>());
  });
}

void dyt_backward(const ExecContext& ctx, const Tensor& x, const Tensor& alpha, const Tensor& w, const Tensor& dy, const Tensor& dx,
                  const Tensor& dalpha, const Tensor& dw, const Tensor& db, bool accumulate_dx, const Tensor& dx_copy) {
  const char* op = "dyt_backward";
  KILN_OP_SCOPE(op, x);
  const bool mixed = is_mixed(dy);
  validate(op, x, alpha, w, mixed);
  expect_tensor(op, "dy", dy, x.shape(), output_dtype(x, mixed), x.device());
  expect_tensor(op, "dx", dx, x.shape(), x.dtype(), x.device());
  const DType p = param_dtype(x);
  if (dalpha.defined()) expect_tensor(op, "dalpha", dalpha, Shape{1}, p, x.device());
  KILN_CHECK(!dw.defined() || w.defined(), op, "dw given for a DyT without gain");
  if (dw.defined()) expect_tensor(op, "dw", dw, Shape{x.size(1)}, p, x.device());
  if (db.defined()) expect_tensor(op, "db", db, Shape{x.size(1)}, p, x.device());
  // The mixed path writes the copy in the same pass, so it must be bf16 there; elsewhere the
  // copy is a conversion after the backward.
  if (dx_copy.defined())
    expect_tensor(op, "dx_copy", dx_copy, x.shape(), mixed ? DType::bf16 : dx_copy.dtype(), x.device());
  const Tensor copy_in_pass = mixed ? dx_copy : Tensor();
  if (x.device() == Device::cuda) {
#if KILN_WITH_CUDA
    cuda::dyt_backward(ctx, x.raw(), x.dtype(), alpha.data<float>(), w.data_or_null<float>(), dy.raw(), dy.dtype(), x.size(0),
                       x.size(1), dx.raw(), accumulate_dx, dalpha.data_or_null<float>(), dw.data_or_null<float>(), db.data_or_null<float>(),
                       copy_in_pass.defined() ? copy_in_pass.raw() : nullptr);
#else
    no_cuda_kernel(op);
#endif
  } else {
    dispatch_cpu_float(op, x.dtype(), [&](auto zero) {
      using T = decltype(zero);
      backward_cpu<T>(x.data<T>(), alpha.data<T>()[0], w.defined() ? w.data<T>() : nullptr, dy.data<T>(), x.size(0),
                      x.size(1), dx.data<T>(), accumulate_dx, dalpha.defined() ? dalpha.data<T>() : nullptr,
                      dw.defined() ? dw.data<T>() : nullptr, db.defined() ? db.data<T>() : nullptr);
    });
  }
  if (dx_copy.defined() && !copy_in_pass.defined()) convert(ctx, dx, dx_copy);
}

}  // namespace kiln::ops

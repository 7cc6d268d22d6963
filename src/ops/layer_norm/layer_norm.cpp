#include "ops/layer_norm/layer_norm.h"

#include "core/op_profiler.h"
#include "ops/common.h"
#include "ops/elementwise/elementwise.h"
#include "ops/layer_norm/layer_norm_cpu.h"
#if KILN_WITH_CUDA
#include "ops/layer_norm/layer_norm_cuda.h"
#endif

namespace kiln::ops {

namespace {

// The statistics' dtype: x's on the CPU (f32 or f64), f32 on the GPU (both paths).
DType stats_dtype(const Tensor& x) { return x.device() == Device::cuda ? DType::f32 : x.dtype(); }

// x [R, C] with optional gain and bias [C] and the saved statistics [R]. On the GPU x is
// f32 (the fp32 path, or the mixed path's residual stream) or bf16 (mixed path only).
void validate(const char* op, const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& mean,
              const Tensor& rstd, bool mixed) {
  expect_rank(op, "x", x, 2);
  const DType stats = stats_dtype(x);
  if (w.defined()) expect_tensor(op, "w", w, Shape{x.size(1)}, stats, x.device());
  if (b.defined()) expect_tensor(op, "b", b, Shape{x.size(1)}, stats, x.device());
  expect_tensor(op, "mean", mean, Shape{x.size(0)}, stats, x.device());
  expect_tensor(op, "rstd", rstd, Shape{x.size(0)}, stats, x.device());
  if (x.device() == Device::cuda)
    KILN_CHECK(x.dtype() == DType::f32 || (mixed && x.dtype() == DType::bf16), op,
               "x must be f32{} on the GPU, got {}", mixed ? " or bf16" : "", x.describe());
}

// y's (and dy's) dtype: bf16 on the mixed path, else x's.
DType output_dtype(const Tensor& x, bool mixed) { return mixed ? DType::bf16 : x.dtype(); }

}  // namespace

void layer_norm_forward(const ExecContext& ctx, const Tensor& x, const Tensor& w, const Tensor& b, double eps, const Tensor& y,
                        const Tensor& mean, const Tensor& rstd) {
  const char* op = "layer_norm";
  KILN_OP_SCOPE(op, x);
  const bool mixed = is_mixed(y);
  validate(op, x, w, b, mean, rstd, mixed);
  expect_tensor(op, "y", y, x.shape(), output_dtype(x, mixed), x.device());
  KILN_CHECK(eps > 0, op, "eps must be positive, got {}", eps);
  KILN_ON_CUDA(x, op,
               cuda::layer_norm_forward(ctx, x.raw(), x.dtype(), w.data_or_null<float>(), b.data_or_null<float>(), static_cast<float>(eps),
                                        x.size(0), x.size(1), y.raw(), y.dtype(), mean.data<float>(),
                                        rstd.data<float>()));
  dispatch_cpu_float(op, x.dtype(), [&](auto zero) {
    using T = decltype(zero);
    cpu::layer_norm_forward<T>(x.data<T>(), w.defined() ? w.data<T>() : nullptr, b.defined() ? b.data<T>() : nullptr,
                               eps, x.size(0), x.size(1), y.data<T>(), mean.data<T>(), rstd.data<T>());
  });
}

void add_layer_norm_forward(const ExecContext& ctx, const Tensor& a, const Tensor& branch, const Tensor& w, const Tensor& b, double eps,
                            const Tensor& sum, const Tensor& y, const Tensor& mean, const Tensor& rstd) {
  const char* op = "add_layer_norm";
  if (a.device() == Device::cpu) {  // the reference: the two ops in turn
    add(ctx, a, branch, sum);
    layer_norm_forward(ctx, sum, w, b, eps, y, mean, rstd);
    return;
  }
  KILN_OP_SCOPE(op, a);
  const bool mixed = is_mixed(y);
  validate(op, a, w, b, mean, rstd, mixed);
  expect_dtype(op, "a", a, DType::f32);  // the residual stream
  expect_tensor(op, "branch", branch, a.shape(), output_dtype(a, mixed), a.device());
  expect_tensor(op, "sum", sum, a.shape(), DType::f32, a.device());
  expect_tensor(op, "y", y, a.shape(), output_dtype(a, mixed), a.device());
  KILN_CHECK(sum.raw() != a.raw() && sum.raw() != branch.raw(), op, "sum must not alias a or branch");
  KILN_CHECK(eps > 0, op, "eps must be positive, got {}", eps);
  KILN_ON_CUDA(a, op,
               cuda::layer_norm_forward(ctx, a.raw(), DType::f32, w.data_or_null<float>(), b.data_or_null<float>(), static_cast<float>(eps),
                                        a.size(0), a.size(1), y.raw(), y.dtype(), mean.data<float>(),
                                        rstd.data<float>(), branch.raw(), sum.data<float>()));
}

void layer_norm_backward(const ExecContext& ctx, const Tensor& x, const Tensor& w, const Tensor& mean, const Tensor& rstd, const Tensor& dy,
                         const Tensor& dx, const Tensor& dw, const Tensor& db, bool accumulate_dx,
                         const Tensor& dx_copy) {
  const char* op = "layer_norm_backward";
  KILN_OP_SCOPE(op, x);
  const bool mixed = is_mixed(dy);
  validate(op, x, w, Tensor(), mean, rstd, mixed);
  expect_tensor(op, "dy", dy, x.shape(), output_dtype(x, mixed), x.device());
  expect_tensor(op, "dx", dx, x.shape(), x.dtype(), x.device());
  KILN_CHECK(!dw.defined() || w.defined(), op, "dw given for a norm without gain");
  if (dw.defined()) expect_tensor(op, "dw", dw, w.shape(), w.dtype(), w.device());
  if (db.defined()) expect_tensor(op, "db", db, Shape{x.size(1)}, stats_dtype(x), x.device());
  // The mixed path writes the copy in the same pass, so it must be bf16 there; elsewhere
  // the copy is a conversion after the backward.
  if (dx_copy.defined())
    expect_tensor(op, "dx_copy", dx_copy, x.shape(), mixed ? DType::bf16 : dx_copy.dtype(), x.device());
  const Tensor copy_in_pass = mixed ? dx_copy : Tensor();
  if (x.device() == Device::cuda) {
#if KILN_WITH_CUDA
    cuda::layer_norm_backward(ctx, x.raw(), x.dtype(), w.data_or_null<float>(), mean.data<float>(), rstd.data<float>(), dy.raw(),
                              dy.dtype(), x.size(0), x.size(1), dx.raw(), accumulate_dx, dw.data_or_null<float>(),
                              db.data_or_null<float>(), copy_in_pass.defined() ? copy_in_pass.raw() : nullptr);
#else
    no_cuda_kernel(op);
#endif
  } else {
    dispatch_cpu_float(op, x.dtype(), [&](auto zero) {
      using T = decltype(zero);
      cpu::layer_norm_backward<T>(x.data<T>(), w.defined() ? w.data<T>() : nullptr, mean.data<T>(), rstd.data<T>(),
                                  dy.data<T>(), x.size(0), x.size(1), dx.data<T>(),
                                  dw.defined() ? dw.data<T>() : nullptr, db.defined() ? db.data<T>() : nullptr,
                                  accumulate_dx);
    });
  }
  if (dx_copy.defined() && !copy_in_pass.defined()) convert(ctx, dx, dx_copy);
}

}  // namespace kiln::ops

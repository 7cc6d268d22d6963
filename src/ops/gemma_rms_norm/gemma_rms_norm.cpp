#include "ops/gemma_rms_norm/gemma_rms_norm.h"

#include "core/op_profiler.h"
#include "ops/common.h"
#include "ops/rms_norm/rms_norm.h"
#if KILN_WITH_CUDA
#include "ops/gemma_rms_norm/gemma_gain_cuda.h"
#endif

namespace kiln::ops {

void gemma_gain(const ExecContext& ctx, const Tensor& w, const Tensor& gain) {
  const char* op = "gemma_gain";
  KILN_OP_SCOPE(op, w);
  expect_rank(op, "w", w, 1);
  expect_shape(op, "gain", gain, w.shape());
  expect_same(op, "gain", gain, w);
  if (w.device() == Device::cuda) expect_dtype(op, "w", w, DType::f32);
  KILN_ON_CUDA(w, op, cuda::gemma_gain(ctx, w.data<float>(), w.numel(), gain.data<float>()));
  dispatch_cpu_float(op, w.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const T* in = w.data<T>();
    T* out = gain.data<T>();
    for (int64_t i = 0; i < w.numel(); ++i) out[i] = T(1) + in[i];
  });
}

void gemma_rms_norm_forward(const ExecContext& ctx, const Tensor& x, const Tensor& w, double eps, const Tensor& gain, const Tensor& y,
                            const Tensor& rstd) {
  gemma_gain(ctx, w, gain);
  rms_norm_forward(ctx, x, gain, eps, y, rstd);
}

void add_gemma_rms_norm_forward(const ExecContext& ctx, const Tensor& a, const Tensor& b, const Tensor& w, double eps, const Tensor& gain,
                                const Tensor& sum, const Tensor& y, const Tensor& rstd) {
  gemma_gain(ctx, w, gain);
  add_rms_norm_forward(ctx, a, b, gain, eps, sum, y, rstd);
}

void gemma_rms_norm_backward(const ExecContext& ctx, const Tensor& x, const Tensor& gain, const Tensor& rstd, const Tensor& dy,
                             const Tensor& dx, const Tensor& dw, bool accumulate_dx, const Tensor& dx_copy) {
  rms_norm_backward(ctx, x, gain, rstd, dy, dx, dw, accumulate_dx, dx_copy);
}

}  // namespace kiln::ops

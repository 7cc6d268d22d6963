#include "ops/short_conv/short_conv.h"

#include "core/op_profiler.h"
#include "ops/common.h"
#include "ops/stable_math.h"
#if KILN_WITH_CUDA
#include "ops/kda/kda_decode_cuda.h"
#include "ops/kda/kda_mixer_cuda.h"
#include "ops/short_conv/short_conv_sweep_cuda.h"
#endif

#include <cmath>
#include <utility>

namespace kiln::ops {

namespace {

void validate(const char* op, const Tensor& x, const Tensor& w, bool has_cuda_kernel = true) {
  expect_rank(op, "x", x, 2);
  expect_rank(op, "w", w, 2);
  if (x.device() == Device::cuda) {
    if (!has_cuda_kernel) no_cuda_kernel(op);
    KILN_CHECK(x.dtype() == DType::f32 || x.dtype() == DType::bf16, op, "x must be f32 or bf16 on the GPU, got {}",
               x.describe());
  }
  KILN_CHECK(w.size(0) == x.size(1), op, "w {} must have one row per channel of x {}", w.describe(), x.describe());
  expect_same(op, "w", w, x);
}

// On the GPU cu_seqlens lives on the device and is trusted (not read back), as attention's.
void validate_seqlens(const char* op, const Tensor& x, const Tensor& cu_seqlens) {
  expect_tensor(op, "cu_seqlens", cu_seqlens, Shape{cu_seqlens.size(0)}, DType::i32, x.device());
  KILN_CHECK(cu_seqlens.size(0) >= 2, op, "cu_seqlens needs at least 2 entries");
  if (x.device() == Device::cuda) return;
  const int32_t* cu = cu_seqlens.data<int32_t>();
  const int64_t s = cu_seqlens.size(0) - 1;
  KILN_CHECK(s >= 1 && cu[0] == 0 && cu[s] == x.size(0), op, "cu_seqlens must run from 0 to {} tokens", x.size(0));
  for (int64_t i = 0; i < s; ++i) KILN_CHECK(cu[i] <= cu[i + 1], op, "cu_seqlens must not decrease (entry {})", i + 1);
}

// The convolution before SiLU at token t of a document starting at `start`, channel c.
template <typename T>
T conv_at(const T* x, const T* w, int64_t channels, int64_t kernel, int64_t start, int64_t t, int64_t c) {
  T sum = 0;
  for (int64_t j = 0; j < kernel; ++j) {
    const int64_t src = t - kernel + 1 + j;
    if (src >= start) sum += w[c * kernel + j] * x[src * channels + c];
  }
  return sum;
}

}  // namespace

void short_conv_forward(const ExecContext& ctx, const Tensor& x, const Tensor& w, const Tensor& cu_seqlens,
                        const Tensor& y, ShortConvGpuKernel gpu_kernel) {
  (void)ctx;  // CPU builds: only the CUDA path reads it
  const char* op = "short_conv_forward";
  KILN_OP_SCOPE(op, x);
  validate(op, x, w);
  validate_seqlens(op, x, cu_seqlens);
  expect_shape(op, "y", y, x.shape());
  expect_same(op, "y", y, x);
  KILN_ON_CUDA(x, op,
               (gpu_kernel == ShortConvGpuKernel::sweep ? cuda::short_conv_sweep_forward : cuda::short_conv_forward)(
                   ctx, x.dtype(), x.raw(), w.raw(), cu_seqlens.data<int32_t>(), cu_seqlens.size(0) - 1, x.size(0),
                   x.size(1), w.size(1), y.raw()));
  (void)gpu_kernel;  // CPU builds
  dispatch_cpu_float(op, x.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const int64_t ch = x.size(1), kernel = w.size(1), seqs = cu_seqlens.size(0) - 1;
    const int32_t* cu = cu_seqlens.data<int32_t>();
    const T *xp = x.data<T>(), *wp = w.data<T>();
    T* yp = y.data<T>();
    // One channel per item (one parallel region, not one per document).
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < ch; ++c)
      for (int64_t s = 0; s < seqs; ++s)
        for (int64_t t = cu[s]; t < cu[s + 1]; ++t) {
          const T z = conv_at(xp, wp, ch, kernel, cu[s], t, c);
          yp[t * ch + c] = z * cpu::stable_sigmoid(z);
        }
  });
}

// With z the convolution and dz = dy silu'(z) = dy s (1 + z (1 - s)): dx[src] gathers
// w[j] dz[t] from the K tokens t that read src; dw[c, j] sums dz[t] x[src] over tokens.
void short_conv_backward(const ExecContext& ctx, const Tensor& x, const Tensor& w, const Tensor& cu_seqlens,
                         const Tensor& dy, const Tensor& dx, const Tensor& dw, ShortConvGpuKernel gpu_kernel) {
  (void)ctx;  // CPU builds: only the CUDA path reads it
  const char* op = "short_conv_backward";
  KILN_OP_SCOPE(op, x);
  validate(op, x, w);
  validate_seqlens(op, x, cu_seqlens);
  for (const auto& [name, t] : {std::pair{"dy", &dy}, {"dx", &dx}}) {
    expect_shape(op, name, *t, x.shape());
    expect_same(op, name, *t, x);
  }
  // dw is the fp32 master gradient on the GPU (w its compute copy there).
  if (dw.defined()) {
    if (x.device() == Device::cuda)
      expect_tensor(op, "dw", dw, w.shape(), DType::f32, Device::cuda);
    else {
      expect_shape(op, "dw", dw, w.shape());
      expect_same(op, "dw", dw, w);
    }
  }
  KILN_ON_CUDA(x, op,
               (gpu_kernel == ShortConvGpuKernel::sweep ? cuda::short_conv_sweep_backward : cuda::short_conv_backward)(
                   ctx, x.dtype(), x.raw(), w.raw(), cu_seqlens.data<int32_t>(), cu_seqlens.size(0) - 1, x.size(0),
                   x.size(1), w.size(1), dy.raw(), dx.raw(), dw.defined() ? dw.data<float>() : nullptr));
  (void)gpu_kernel;  // CPU builds
  dispatch_cpu_float(op, x.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const int64_t n = x.size(0), ch = x.size(1), kernel = w.size(1), seqs = cu_seqlens.size(0) - 1;
    const int32_t* cu = cu_seqlens.data<int32_t>();
    const T *xp = x.data<T>(), *wp = w.data<T>(), *d = dy.data<T>();
    T* dxp = dx.data<T>();
    T* dwp = dw.defined() ? dw.data<T>() : nullptr;
    // One channel per item: it owns its column of dx and its row of dw.
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < ch; ++c) {
      for (int64_t t = 0; t < n; ++t) dxp[t * ch + c] = 0;
      for (int64_t s = 0; s < seqs; ++s)
        for (int64_t t = cu[s]; t < cu[s + 1]; ++t) {
          const T z = conv_at(xp, wp, ch, kernel, cu[s], t, c), sg = cpu::stable_sigmoid(z);
          const T dz = d[t * ch + c] * sg * (T(1) + z * (T(1) - sg));
          for (int64_t j = 0; j < kernel; ++j) {
            const int64_t src = t - kernel + 1 + j;
            if (src < cu[s]) continue;
            dxp[src * ch + c] += wp[c * kernel + j] * dz;
            if (dwp) dwp[c * kernel + j] += dz * xp[src * ch + c];
          }
        }
    }
  });
}

void short_conv_step(const ExecContext& ctx, const Tensor& x, const Tensor& w, const Tensor& slots,
                     const Tensor& state, const Tensor& y) {
  (void)ctx;  // CPU builds: only the CUDA path reads it
  const char* op = "short_conv_step";
  KILN_OP_SCOPE(op, x);
  validate(op, x, w);
  const int64_t n = x.size(0), ch = x.size(1), kernel = w.size(1);
  // On the GPU the slots live on the device and are trusted (not read back), as the
  // cache ops' are.
  expect_tensor(op, "slots", slots, Shape{n}, DType::i32, x.device());
  expect_rank(op, "state", state, 3);
  KILN_CHECK(state.size(1) == kernel - 1 && state.size(2) == ch, op, "state {} must be [slots, {}, {}]",
             state.describe(), kernel - 1, ch);
  expect_same(op, "state", state, x);
  expect_shape(op, "y", y, x.shape());
  expect_same(op, "y", y, x);
  KILN_ON_CUDA(x, op,
               cuda::short_conv_step(ctx, x.dtype(), x.raw(), w.raw(), slots.data<int32_t>(), n, ch, kernel,
                                     state.raw(), y.raw()));
  dispatch_cpu_float(op, x.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const int32_t* slot = slots.data<int32_t>();
    const T *xp = x.data<T>(), *wp = w.data<T>();
    T *yp = y.data<T>(), *st = state.data<T>();
    const int64_t held = kernel - 1;
    // Rows in order: a slot's later row reads the state its earlier row left.
    for (int64_t i = 0; i < n; ++i) {
      KILN_CHECK(slot[i] >= 0 && slot[i] < state.size(0), op, "row {}: slot {} outside the state's {}", i, slot[i],
                 state.size(0));
      T* past = st + slot[i] * held * ch;
      for (int64_t c = 0; c < ch; ++c) {
        T z = wp[c * kernel + held] * xp[i * ch + c];
        for (int64_t j = 0; j < held; ++j) z += wp[c * kernel + j] * past[j * ch + c];
        yp[i * ch + c] = z * cpu::stable_sigmoid(z);
        for (int64_t j = 0; j + 1 < held; ++j) past[j * ch + c] = past[(j + 1) * ch + c];
        if (held > 0) past[(held - 1) * ch + c] = xp[i * ch + c];
      }
    }
  });
}

}  // namespace kiln::ops

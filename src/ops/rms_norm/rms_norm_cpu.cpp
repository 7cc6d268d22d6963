// CPU reference for RMSNorm. Statistics accumulate in at least fp32 (double for f64).
#include "ops/rms_norm/rms_norm_cpu.h"

#include <algorithm>
#include <cmath>
#include <type_traits>

namespace kiln::cpu {

template <typename T>
void rms_norm_forward(const T* x, const T* w, double eps, int64_t rows, int64_t cols, T* y, T* rstd) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * cols;
    T* yr = y + r * cols;
    T sum_sq = 0;
    for (int64_t c = 0; c < cols; ++c) sum_sq += xr[c] * xr[c];
    const T inv = T(1) / std::sqrt(sum_sq / static_cast<T>(cols) + static_cast<T>(eps));
    rstd[r] = inv;
    for (int64_t c = 0; c < cols; ++c) yr[c] = xr[c] * inv * (w ? w[c] : T(1));
  }
}

// y = x * r * w with r = (mean(x^2) + eps)^-1/2. With g = dy * w:
//   dx = r * (g - x * r^2 * mean(g * x)),   dw += sum over rows of dy * x * r.
template <typename T>
void rms_norm_backward(const T* x, const T* w, const T* rstd, const T* dy, int64_t rows, int64_t cols, T* dx, T* dw,
                       bool accumulate_dx) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * cols;
    const T* gr = dy + r * cols;
    T* dxr = dx + r * cols;
    const T inv = rstd[r];
    T dot = 0;
    for (int64_t c = 0; c < cols; ++c) dot += gr[c] * (w ? w[c] : T(1)) * xr[c];
    const T coef = dot * inv * inv / static_cast<T>(cols);
    for (int64_t c = 0; c < cols; ++c) {
      const T g = gr[c] * (w ? w[c] : T(1));
      const T value = inv * (g - xr[c] * coef);
      dxr[c] = accumulate_dx ? dxr[c] + value : value;
    }
  }
  if (!dw) return;
  // Parallel over blocks of 16 columns: each gain's sum runs over rows in one fixed order
  // (reproducible for any thread count) while each row read is a whole cache line.
  constexpr int64_t kBlock = 16;
  const int64_t blocks = (cols + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t c0 = b * kBlock, width = std::min(kBlock, cols - c0);
    T sum[kBlock] = {};
    for (int64_t r = 0; r < rows; ++r) {
      const T* dyr = dy + r * cols + c0;
      const T* xr = x + r * cols + c0;
      const T inv = rstd[r];
      for (int64_t c = 0; c < width; ++c) sum[c] += dyr[c] * xr[c] * inv;
    }
    for (int64_t c = 0; c < width; ++c) dw[c0 + c] += sum[c];
  }
}

template void rms_norm_forward<float>(const float*, const float*, double, int64_t, int64_t, float*, float*);
template void rms_norm_forward<double>(const double*, const double*, double, int64_t, int64_t, double*, double*);
template void rms_norm_backward<float>(const float*, const float*, const float*, const float*, int64_t, int64_t,
                                       float*, float*, bool);
template void rms_norm_backward<double>(const double*, const double*, const double*, const double*, int64_t,
                                        int64_t, double*, double*, bool);

}  // namespace kiln::cpu

// CPU reference for LayerNorm. Statistics accumulate in T (fp32, or double on the f64 path),
// the variance as the mean of squared deviations from the mean (two passes over the row,
// not E[x^2] - mean^2, which cancels when |mean| >> std).
#include "ops/layer_norm/layer_norm_cpu.h"

#include <algorithm>
#include <cmath>

namespace kiln::cpu {

template <typename T>
void layer_norm_forward(const T* x, const T* w, const T* b, double eps, int64_t rows, int64_t cols, T* y, T* mean,
                        T* rstd) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * cols;
    T* yr = y + r * cols;
    T sum = 0;
    for (int64_t c = 0; c < cols; ++c) sum += xr[c];
    const T mu = sum / static_cast<T>(cols);
    T sum_sq = 0;
    for (int64_t c = 0; c < cols; ++c) sum_sq += (xr[c] - mu) * (xr[c] - mu);
    const T inv = T(1) / std::sqrt(sum_sq / static_cast<T>(cols) + static_cast<T>(eps));
    mean[r] = mu;
    rstd[r] = inv;
    for (int64_t c = 0; c < cols; ++c) yr[c] = (xr[c] - mu) * inv * (w ? w[c] : T(1)) + (b ? b[c] : T(0));
  }
}

// With xhat = (x - mean) * r and g = dy * w:
//   dx = r * (g - mean(g) - xhat * mean(g * xhat)),
//   dw += sum over rows of dy * xhat,   db += sum over rows of dy.
template <typename T>
void layer_norm_backward(const T* x, const T* w, const T* mean, const T* rstd, const T* dy, int64_t rows, int64_t cols,
                         T* dx, T* dw, T* db, bool accumulate_dx) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * cols;
    const T* gr = dy + r * cols;
    T* dxr = dx + r * cols;
    const T mu = mean[r], inv = rstd[r];
    T sum_g = 0, sum_gx = 0;
    for (int64_t c = 0; c < cols; ++c) {
      const T g = gr[c] * (w ? w[c] : T(1));
      sum_g += g;
      sum_gx += g * (xr[c] - mu) * inv;
    }
    const T mean_g = sum_g / static_cast<T>(cols), mean_gx = sum_gx / static_cast<T>(cols);
    for (int64_t c = 0; c < cols; ++c) {
      const T g = gr[c] * (w ? w[c] : T(1));
      const T value = inv * (g - mean_g - (xr[c] - mu) * inv * mean_gx);
      dxr[c] = accumulate_dx ? dxr[c] + value : value;
    }
  }
  if (!dw && !db) return;
  // Parallel over blocks of 16 columns: each column's sums run over the rows in one fixed
  // order (the same bits for any thread count) while each row read is a whole cache line.
  constexpr int64_t kBlock = 16;
  const int64_t blocks = (cols + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t c0 = blk * kBlock, width = std::min(kBlock, cols - c0);
    T sum_w[kBlock] = {}, sum_b[kBlock] = {};
    for (int64_t r = 0; r < rows; ++r) {
      const T* dyr = dy + r * cols + c0;
      const T* xr = x + r * cols + c0;
      const T mu = mean[r], inv = rstd[r];
      for (int64_t c = 0; c < width; ++c) {
        sum_w[c] += dyr[c] * (xr[c] - mu) * inv;
        sum_b[c] += dyr[c];
      }
    }
    for (int64_t c = 0; c < width; ++c) {
      if (dw) dw[c0 + c] += sum_w[c];
      if (db) db[c0 + c] += sum_b[c];
    }
  }
}

template void layer_norm_forward<float>(const float*, const float*, const float*, double, int64_t, int64_t, float*,
                                        float*, float*);
template void layer_norm_forward<double>(const double*, const double*, const double*, double, int64_t, int64_t,
                                         double*, double*, double*);
template void layer_norm_backward<float>(const float*, const float*, const float*, const float*, const float*, int64_t,
                                         int64_t, float*, float*, float*, bool);
template void layer_norm_backward<double>(const double*, const double*, const double*, const double*, const double*,
                                          int64_t, int64_t, double*, double*, double*, bool);

}  // namespace kiln::cpu

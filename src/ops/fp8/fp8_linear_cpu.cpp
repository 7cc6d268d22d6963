#include "ops/fp8/fp8_linear_cpu.h"

#include "core/error.h"
#include "ops/fp8/fp8_scaling.h"

#include <algorithm>
#include <cmath>

namespace kiln::ops::fp8 {

void quantize_dequantize_tensorwise(const float* x, int64_t rows, int64_t cols, Format format, float* out,
                                    bool transpose, const char* what) {
  const int64_t count = rows * cols;
  float amax = 0;
  bool finite = true;  // std::max would pass over a NaN
  for (int64_t i = 0; i < count; ++i) {
    finite = finite && std::isfinite(x[i]);
    amax = std::max(amax, std::fabs(x[i]));
  }
  KILN_CHECK(finite, "fp8_tensorwise", "{} [{}, {}] holds a non-finite value: no FP8 scale for it",
             what, rows, cols);
  // quantize()'s arithmetic, element for element (fp8_scaling.cpp).
  const float scale = scale_from_amax(amax, format);
  const float scale_inv = 1.0f / scale;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const float value = decode(encode(x[r * cols + c] * scale, format, Overflow::saturate), format) * scale_inv;
      out[transpose ? c * rows + r : r * cols + c] = value;
    }
}

void quantize_dequantize_blockwise(const float* x, int64_t rows, int64_t cols, BlockShape block, Format format,
                                   float* out, bool transpose, const char* what) {
  const int64_t grid_rows = (rows + block.rows - 1) / block.rows, grid_cols = (cols + block.cols - 1) / block.cols;
  bool finite = true;
#pragma omp parallel for schedule(static) reduction(&& : finite)
  for (int64_t b = 0; b < grid_rows * grid_cols; ++b) {
    const int64_t row0 = b / grid_cols * block.rows, col0 = b % grid_cols * block.cols;
    const int64_t row_end = std::min(rows, row0 + block.rows), col_end = std::min(cols, col0 + block.cols);
    float amax = 0;
    bool block_finite = true;
    for (int64_t r = row0; r < row_end; ++r)
      for (int64_t c = col0; c < col_end; ++c) {
        block_finite = block_finite && std::isfinite(x[r * cols + c]);
        amax = std::max(amax, std::fabs(x[r * cols + c]));
      }
    if (!block_finite) {  // reported after the loop: nothing may throw inside it
      finite = false;
      continue;
    }
    const float scale = scale_from_amax(amax, format);
    const float scale_inv = 1.0f / scale;
    for (int64_t r = row0; r < row_end; ++r)
      for (int64_t c = col0; c < col_end; ++c) {
        const float value = decode(encode(x[r * cols + c] * scale, format, Overflow::saturate), format) * scale_inv;
        out[transpose ? c * rows + r : r * cols + c] = value;
      }
  }
  KILN_CHECK(finite, "fp8_blockwise", "{} [{}, {}] holds a non-finite value: no FP8 scale for its block", what, rows,
             cols);
}

void add_bias_rows(float* y, const float* bias, int64_t n, int64_t out) {
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < out; ++j) y[i * out + j] += bias[j];
}

void gemm_rounded(int64_t m, int64_t n, int64_t k, const float* a, int64_t a_row, int64_t a_col, const float* b,
                  float* c, bool accumulate, float* scratch) {
  KILN_CHECK(!accumulate || scratch != nullptr, "fp8_tensorwise", "an accumulating GEMM needs its scratch");
  float* sums = accumulate ? scratch : c;
  // Row i's sums in ascending p, vectorized across j: each c_ij sees the same additions in
  // the same order as gemm_reference's inner loop (this file is built without contraction).
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < m; ++i) {
    float* row = sums + i * n;
    std::fill(row, row + n, 0.0f);
    for (int64_t p = 0; p < k; ++p) {
      const float a_ip = a[i * a_row + p * a_col];
      const float* b_row = b + p * n;
      for (int64_t j = 0; j < n; ++j) row[j] += a_ip * b_row[j];
    }
    if (accumulate)
      for (int64_t j = 0; j < n; ++j) c[i * n + j] += row[j];
  }
}

}  // namespace kiln::ops::fp8

#include "ops/fp8/fp8_scaling.h"

#include "core/error.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace kiln::ops::fp8 {

float scale_from_amax(float amax, Format format) {
  KILN_CHECK(std::isfinite(amax) && amax >= 0, "fp8", "amax must be finite and >= 0, got {}", amax);
  if (amax == 0) return 1.0f;  // an all-zero block: any scale reproduces it
  const float scale = info(format).max / amax;
  // A block of tiny values (amax below fp8_max / FLT_MAX) would get an infinite scale and
  // turn 0 * inf into NaN; the largest float keeps it finite (Transformer Engine does the same).
  return std::isinf(scale) ? std::numeric_limits<float>::max() : scale;
}

ScaledMatrix quantize(std::span<const float> x, int64_t rows, int64_t cols, BlockShape block, Format format) {
  KILN_CHECK(rows >= 0 && cols >= 0 && static_cast<int64_t>(x.size()) == rows * cols, "fp8",
             "quantize: {} values for a [{}, {}] matrix", x.size(), rows, cols);
  KILN_CHECK(block.rows > 0 && block.cols > 0, "fp8", "quantize: block shape [{}, {}] must be positive",
             block.rows, block.cols);
  ScaledMatrix q;
  q.format = format;
  q.rows = rows;
  q.cols = cols;
  q.block = block;
  q.codes.resize(x.size());
  q.scale_inv.resize(q.block_grid_rows() * q.block_grid_cols());
  for (int64_t br = 0; br < q.block_grid_rows(); ++br) {
    for (int64_t bc = 0; bc < q.block_grid_cols(); ++bc) {
      const int64_t row_end = std::min(rows, (br + 1) * block.rows);
      const int64_t col_end = std::min(cols, (bc + 1) * block.cols);
      float amax = 0;
      for (int64_t r = br * block.rows; r < row_end; ++r)
        for (int64_t c = bc * block.cols; c < col_end; ++c) {
          const float v = x[r * cols + c];
          KILN_CHECK(std::isfinite(v), "fp8", "quantize: element ({}, {}) of block ({}, {}) is {}", r, c, br, bc, v);
          amax = std::max(amax, std::fabs(v));
        }
      const float scale = scale_from_amax(amax, format);
      q.scale_inv[br * q.block_grid_cols() + bc] = 1.0f / scale;
      for (int64_t r = br * block.rows; r < row_end; ++r)
        for (int64_t c = bc * block.cols; c < col_end; ++c)
          q.codes[r * cols + c] = encode(x[r * cols + c] * scale, format, Overflow::saturate);
    }
  }
  return q;
}

ScaledMatrix quantize_tensorwise(std::span<const float> x, int64_t rows, int64_t cols, Format format) {
  // One block covering everything (at least 1 x 1, so an empty matrix still has a shape).
  return quantize(x, rows, cols, {std::max<int64_t>(rows, 1), std::max<int64_t>(cols, 1)}, format);
}

std::vector<float> dequantize(const ScaledMatrix& q) {
  std::vector<float> out(q.codes.size());
  for (int64_t r = 0; r < q.rows; ++r)
    for (int64_t c = 0; c < q.cols; ++c)
      out[r * q.cols + c] = decode(q.codes[r * q.cols + c], q.format) * q.scale_inv_of(r, c);
  return out;
}

}  // namespace kiln::ops::fp8

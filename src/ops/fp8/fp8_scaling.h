// Scaled FP8 tensors on the CPU: the reference for the quantize kernels (amax and cast) of
// the FP8 recipes, bit for bit.
//
// A matrix [rows, cols] (row-major fp32) is cut into blocks of block.rows x block.cols; a
// partial block at the bottom or right edge is a block of its own. Each block gets
//   amax      = max |x| over the block
//   scale     = fp8_max / amax    (fp32 division; 1 when amax is 0, FLT_MAX if it overflows)
//   code      = encode(x * scale) (fp32 product, then round-to-nearest-even, saturating)
//   scale_inv = 1 / scale         (fp32 division), what is stored and what dequantize uses:
//   value     = decode(code) * scale_inv
// so a block's largest element lands on fp8_max (saturation only absorbs the fp32 rounding
// of amax * scale). The scale rule is
// Transformer Engine's current scaling (no amax history); stored inverse scales are
// DeepSeek-V3's layout. The shapes in use:
//   per-tensor (TE "current scaling"):  one block, the whole matrix;
//   DeepSeek-V3 activations:            1 x 128 tiles along the last dimension;
//   DeepSeek-V3 weights:                128 x 128 blocks.
#pragma once

#include "ops/fp8/fp8_format.h"

#include <cstdint>
#include <span>
#include <vector>

namespace kiln::ops::fp8 {

struct BlockShape {
  int64_t rows;
  int64_t cols;
};

inline constexpr BlockShape kActivationTile{1, 128};
inline constexpr BlockShape kWeightBlock{128, 128};

// A quantized matrix: codes [rows, cols] and one inverse scale per block, both row-major.
struct ScaledMatrix {
  Format format = Format::e4m3;
  int64_t rows = 0;
  int64_t cols = 0;
  BlockShape block{1, 1};
  std::vector<uint8_t> codes;     // rows * cols
  std::vector<float> scale_inv;   // block_grid_rows() * block_grid_cols()

  int64_t block_grid_rows() const { return (rows + block.rows - 1) / block.rows; }
  int64_t block_grid_cols() const { return (cols + block.cols - 1) / block.cols; }
  // The inverse scale of the block that holds element (row, col).
  float scale_inv_of(int64_t row, int64_t col) const {
    return scale_inv[(row / block.rows) * block_grid_cols() + col / block.cols];
  }
};

// fp8_max / amax with the edge cases above; amax must be finite and >= 0.
float scale_from_amax(float amax, Format format);

// Blocks of any shape. Throws kiln::Error naming the block when it holds a non-finite value
// (an amax of inf or NaN gives no usable scale).
ScaledMatrix quantize(std::span<const float> x, int64_t rows, int64_t cols, BlockShape block, Format format);
// One scale for the whole matrix (Transformer Engine's per-tensor current scaling).
ScaledMatrix quantize_tensorwise(std::span<const float> x, int64_t rows, int64_t cols, Format format);

// [rows, cols] fp32: decode(code) * its block's scale_inv.
std::vector<float> dequantize(const ScaledMatrix& q);

}  // namespace kiln::ops::fp8

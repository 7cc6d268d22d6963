// The second pass of a fixed-order column reduction: kernels that reduce over many rows
// (norm gain gradients) let each block write one row of per-column partial sums, then add
// those rows here, always in the same order, so the result is the same bits every run
// (no atomics). CUDA translation units only.
#pragma once

#include <cstdint>

namespace kiln::cuda {

// Block (kColumnSumCols, Slices): threadIdx.x picks the column (a warp reads 32 consecutive
// floats), threadIdx.y the slice of partial rows b = y, y + Slices, ... it adds; the slices
// are then added in order. Returns the column's total to every thread with threadIdx.y == 0
// (and c < cols); the caller adds it where it belongs. The order depends on Slices, so a
// caller keeps its value.
constexpr int kColumnSumCols = 32;

template <int Slices>
__device__ __forceinline__ bool column_total(const float* __restrict__ partials, int64_t rows, int64_t cols,
                                             int64_t c, float& total) {
  __shared__ float slice[Slices][kColumnSumCols + 1];
  float sum = 0.0f;
  if (c < cols)
#pragma unroll 8
    for (int64_t b = threadIdx.y; b < rows; b += Slices) sum += partials[b * cols + c];
  slice[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y != 0 || c >= cols) return false;
  total = 0.0f;
#pragma unroll
  for (int s = 0; s < Slices; ++s) total += slice[s][threadIdx.x];
  return true;
}

}  // namespace kiln::cuda

// The grid-stride loop of the elementwise kernels: i runs over [0, n) with the whole grid
// in steps of its size, so any grid (blocks_for caps it) covers any n. CUDA translation
// units only.
#pragma once

#include <cstdint>

#define KILN_GRID_STRIDE(i, n)                                                                        \
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < (n); \
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)

// Warp-wide reductions by an xor butterfly (offsets 16, 8, 4, 2, 1): every lane ends with
// the result, and the order of the additions is fixed, so the same inputs give the same
// bits on every lane and every run. The whole warp must take part. CUDA translation units only.
#pragma once

namespace kiln::cuda {

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

}  // namespace kiln::cuda

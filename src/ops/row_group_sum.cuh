// Sum over the threads of a row group: the kThreads consecutive threads of a block that
// own one row (kThreads = 8, 16, 32 or a whole block of up to 1024). Shuffles in an xor
// butterfly within a warp, then, for groups wider than a warp, the warps' partials through
// shared memory, every warp reducing them in the same order: all threads of the group get
// the same total, and the same inputs give the same bits every run. All threads of the
// block must call it together (the shuffles use the full warp; the block form has
// barriers). rms_norm_bf16.cu has the same reduction inline. CUDA translation units only.
#pragma once

namespace kiln::cuda {

template <int kThreads>
__device__ __forceinline__ float row_group_sum(float v) {
  constexpr int kWarp = 32;
  constexpr int kWarpWidth = kThreads < kWarp ? kThreads : kWarp;
  static_assert(kWarpWidth > 0 && (kWarpWidth & (kWarpWidth - 1)) == 0, "groups are a power of two wide");
#pragma unroll
  for (int offset = kWarpWidth / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  if constexpr (kThreads <= kWarp) {
    return v;
  } else {
    static_assert(kThreads % kWarp == 0 && kThreads / kWarp <= kWarp);
    __shared__ float partial[kThreads / kWarp];
    const int lane = threadIdx.x % kWarp;
    __syncthreads();  // partial may still be read by the previous call
    if (lane == 0) partial[threadIdx.x / kWarp] = v;
    __syncthreads();
    v = lane < kThreads / kWarp ? partial[lane] : 0.0f;
#pragma unroll
    for (int offset = kWarp / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
  }
}

}  // namespace kiln::cuda

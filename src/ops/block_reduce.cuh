// Reductions across the threads that share one row: a group of G lanes of a warp (G a
// power of two up to 32), or a whole block. One order for every kernel that uses them:
//   - in a group, an xor butterfly over offsets G/2, G/4, ..., 1 (`v = op(v, partner)`);
//   - in a block, the butterfly in each warp, then lane 0 of every warp writes its warp's
//     value to shared memory, and the warps' values (padded with the identity to 32)
//     meet in one more warp butterfly.
// The order depends only on G or the block size, so a launch shape gives the same bits
// every run. For sums and maxima every thread ends with the same bits (x + y == y + x in
// IEEE arithmetic, so the butterfly's mirrored lanes agree). The softmax pair (MaxSum)
// is not exactly commutative (its two products may be contracted into an fma either
// way round), so its block reduction takes warp 0's lane 0 and hands that to every
// thread through shared memory. The whole group (block) must call these together.
// CUDA translation units only.
#pragma once

#include <cuda_runtime.h>

namespace kiln::cuda {

constexpr int kWarpSize = 32;

// ---- operations ----------------------------------------------------------------------------

struct SumOp {
  static constexpr bool kSymmetric = true;  // op(a, b) has the bits of op(b, a)
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const {
    return a + b;
  }
};

struct MaxOp {
  static constexpr bool kSymmetric = true;
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

// A partial softmax denominator: sum of exp(x - max) over the values seen so far. The
// identity is {-inf, 0}.
struct MaxSum {
  float max;
  float sum;
};

// Both parts rescaled to the larger max. Two empty parts (max -inf) stay empty.
__device__ __forceinline__ MaxSum max_sum_combine(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.max, b.max);
  if (m == -INFINITY) return a;
  return {m, a.sum * __expf(a.max - m) + b.sum * __expf(b.max - m)};
}

struct MaxSumOp {
  static constexpr bool kSymmetric = false;
  __device__ __forceinline__ MaxSum operator()(MaxSum a, MaxSum b) const { return max_sum_combine(a, b); }
};

// ---- shuffles ------------------------------------------------------------------------------

__device__ __forceinline__ float shuffle_xor(float v, int offset) { return __shfl_xor_sync(0xffffffffu, v, offset); }
__device__ __forceinline__ double shuffle_xor(double v, int offset) { return __shfl_xor_sync(0xffffffffu, v, offset); }
__device__ __forceinline__ MaxSum shuffle_xor(MaxSum v, int offset) {
  return {__shfl_xor_sync(0xffffffffu, v.max, offset), __shfl_xor_sync(0xffffffffu, v.sum, offset)};
}

// ---- groups of lanes -------------------------------------------------------------------------

// Reduces over aligned groups of G lanes (lanes 0..G-1, G..2G-1, ...). The full warp must
// take part (lanes of groups past the data pass the identity). Lane 0 of each group holds
// the canonical result; with a symmetric op every lane of the group does.
template <int G, typename T, typename Op>
__device__ __forceinline__ T group_reduce(T v, Op op) {
  static_assert(G >= 1 && G <= kWarpSize && (G & (G - 1)) == 0, "G must be a power of two up to a warp");
#pragma unroll
  for (int offset = G / 2; offset > 0; offset /= 2) v = op(v, shuffle_xor(v, offset));
  return v;
}

template <int G>
__device__ __forceinline__ float group_sum(float v) {
  return group_reduce<G>(v, SumOp{});
}
__device__ __forceinline__ float warp_sum(float v) { return group_reduce<kWarpSize>(v, SumOp{}); }
__device__ __forceinline__ float warp_max(float v) { return group_reduce<kWarpSize>(v, MaxOp{}); }

// ---- blocks ----------------------------------------------------------------------------------

// Reduces over the first kThreads threads of the block (all of them call it; at most 32
// warps); kThreads <= 32 is a group reduction. Every thread gets the result.
template <int kThreads, typename T, typename Op>
__device__ __forceinline__ T block_reduce(T v, Op op, T identity) {
  if constexpr (kThreads <= kWarpSize) {
    return group_reduce<kThreads>(v, op);
  } else {
    static_assert(kThreads % kWarpSize == 0 && kThreads / kWarpSize <= kWarpSize);
    constexpr int kWarps = kThreads / kWarpSize;
    __shared__ T partial[kWarps];
    const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
    v = group_reduce<kWarpSize>(v, op);
    if constexpr (Op::kSymmetric) {
      __syncthreads();  // partial may still be read by the previous call
      if (lane == 0) partial[warp] = v;
      __syncthreads();
      // Each warp reduces the same partials in the same order: all see one value.
      return group_reduce<kWarpSize>(lane < kWarps ? partial[lane] : identity, op);
    } else {
      __shared__ T total;
      if (lane == 0) partial[warp] = v;
      __syncthreads();
      if (warp == 0) {
        v = group_reduce<kWarpSize>(lane < kWarps ? partial[lane] : identity, op);
        if (lane == 0) total = v;
      }
      __syncthreads();
      return total;
    }
  }
}

template <int kThreads>
__device__ __forceinline__ float block_sum(float v) {
  return block_reduce<kThreads>(v, SumOp{}, 0.0f);
}
template <int kThreads>
__device__ __forceinline__ double block_sum(double v) {
  return block_reduce<kThreads>(v, SumOp{}, 0.0);
}
template <int kThreads>
__device__ __forceinline__ float block_max(float v) {
  return block_reduce<kThreads>(v, MaxOp{}, -INFINITY);
}
// The softmax pair of a row: every thread gets warp 0's lane 0 result.
template <int kThreads>
__device__ __forceinline__ MaxSum block_max_sum(MaxSum v) {
  return block_reduce<kThreads>(v, MaxSumOp{}, MaxSum{-INFINITY, 0.0f});
}

// Sums of M rows at once over a block of kThreads threads, with one barrier for all of
// them (the decode kernels' staged RMSNorms, where the barrier count is the cost): each
// warp's butterfly, lane 0's results into scratch ([M][kThreads / 32] floats of shared
// memory, not read again by the caller before a barrier), then every thread adds the
// warps' values in warp order. A second order beside block_reduce's, kept because the
// decode path was measured and checked with it; every thread gets the same bits.
template <int kThreads, int M>
__device__ __forceinline__ void block_sum_rows(float (&v)[M], float* scratch) {
  static_assert(kThreads % kWarpSize == 0);
  constexpr int kWarps = kThreads / kWarpSize;
#pragma unroll
  for (int r = 0; r < M; ++r) v[r] = warp_sum(v[r]);
  if (threadIdx.x % kWarpSize == 0)
#pragma unroll
    for (int r = 0; r < M; ++r) scratch[r * kWarps + threadIdx.x / kWarpSize] = v[r];
  __syncthreads();
#pragma unroll
  for (int r = 0; r < M; ++r) {
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) total += scratch[r * kWarps + w];
    v[r] = total;
  }
}

}  // namespace kiln::cuda

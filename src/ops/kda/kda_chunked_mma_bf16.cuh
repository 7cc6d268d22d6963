// A warp's 16 x 16 tile of a matrix product on the bf16 tensor cores (mma.sync m16n8k16,
// fp32 accumulation) whose operands each lane loads straight into its fragment registers
// through accessors: a(r, k) and b(k, n) return op(A) and op(B)'s elements as floats (from
// global or shared memory, transposed or not, zero past a chunk's length, scaled on the
// fly), rounded to bf16 in registers. No staging tile and no layout rule: what wmma's fp32
// fragments needed (a copy of dO in fp32, 16-float-aligned tiles) goes away. The grads_bf16
// kernels (kda_chunked_grads_bf16.cu) deal their output tiles round the block's warps and
// hand each element to an epilogue, so every output is one lane's sum in a fixed k order
// (the same bits every run).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace kiln::cuda::kda_chunked {

// A warp's accumulators for a 16 x 16 tile: two m16n8 halves of four floats a lane.
struct WarpTile {
  float acc[2][4] = {};

  // The tile element that accumulator (half, n) of this lane holds (mma.sync's C layout).
  __device__ static int row(int n) { return (threadIdx.x & 31) / 4 + 8 * (n / 2); }
  __device__ static int col(int half, int n) { return 8 * half + 2 * (threadIdx.x & 3) + (n & 1); }

  // f(r, c, value) for the lane's eight elements.
  template <typename F>
  __device__ void each(F&& f) const {
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
      for (int n = 0; n < 4; ++n) f(row(n), col(half, n), acc[half][n]);
  }
};

__device__ __forceinline__ uint32_t bf16_pair(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x, the lower half, is lo
  return *reinterpret_cast<const uint32_t*>(&v);
}

// tile += op(A) [16, K] op(B) [K, 16] (K a multiple of 16); every lane of the warp calls it.
template <typename OpA, typename OpB>
__device__ void warp_mma_bf16(int K, OpA a, OpB b, WarpTile& tile) {
  const int g = (threadIdx.x & 31) / 4, t2 = 2 * (threadIdx.x & 3);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  (void)g, (void)t2;
  for (int k = 0; k < K; ++k)  // no bf16 mma.sync: fp32 lanes on the same elements
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
      for (int n = 0; n < 4; ++n) tile.acc[half][n] += a(WarpTile::row(n), k) * b(k, WarpTile::col(half, n));
#else
  for (int k0 = 0; k0 < K; k0 += 16) {
    // A's fragment (row-major 16 x 16): rows g, g + 8; columns t2, t2 + 1, t2 + 8, t2 + 9.
    const uint32_t a0 = bf16_pair(a(g, k0 + t2), a(g, k0 + t2 + 1));
    const uint32_t a1 = bf16_pair(a(g + 8, k0 + t2), a(g + 8, k0 + t2 + 1));
    const uint32_t a2 = bf16_pair(a(g, k0 + t2 + 8), a(g, k0 + t2 + 9));
    const uint32_t a3 = bf16_pair(a(g + 8, k0 + t2 + 8), a(g + 8, k0 + t2 + 9));
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      // B's fragment (16 x 8, column n = g of this half): rows t2, t2 + 1, t2 + 8, t2 + 9.
      const int n = 8 * half + g;
      const uint32_t b0 = bf16_pair(b(k0 + t2, n), b(k0 + t2 + 1, n));
      const uint32_t b1 = bf16_pair(b(k0 + t2 + 8, n), b(k0 + t2 + 9, n));
      float* c = tile.acc[half];
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
          "{%0, %1, %2, %3};\n"
          : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
          : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
  }
#endif
}

// tile += op(A) op(B) as warp_mma_bf16, with B carried to about 16 bits of mantissa: each
// b(k, n) split into bf16 hi + bf16 lo (b - hi), two products over the same A fragments.
// For the products whose sums feed dbeta (X_v = M^T dD, X_k = M^T dW): rounding dD and dW
// to bf16 alone put a one-token document's dbeta 7.7e-3 from the fp64 oracle (H100,
// 2026-12-06), past seed 001's 7e-3 bar, where M's diagonal (1) is exact.
template <typename OpA, typename OpB>
__device__ void warp_mma_bf16_split_b(int K, OpA a, OpB b, WarpTile& tile) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  warp_mma_bf16(K, a, b, tile);  // the fp32 lanes round nothing
#else
  const auto hi = [&](int k, int n) { return __bfloat162float(__float2bfloat16_rn(b(k, n))); };
  warp_mma_bf16(K, a, [&](int k, int n) { return b(k, n) - hi(k, n); }, tile);
  warp_mma_bf16(K, a, hi, tile);
#endif
}

}  // namespace kiln::cuda::kda_chunked

// Skinny bf16 products for decoding: C [m, n] = alpha A [m, k] B^T + beta C with m up to
// kMaxSkinnyRows rows (the tokens of a decode step) and B [n, k] row-major (a weight). At these shapes
// the product is a read of B, so the kernel is built for bandwidth: one warp per output
// column j reads row j of B in 16-byte vectors once, against all m rows of A (small, from
// cache), and reduces in a fixed order (the same bits every run). cuBLASLt's kernels for
// m = 1..8 were measured at ~14 us per decode GEMM on the H200, several times the copy
// time of the weight.
#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "ops/bf16_vector.cuh"
#include "ops/linear/gemv_cuda.h"

#include <cuda_bf16.h>

namespace kiln::cuda {

namespace {

constexpr int kWarp = 32;
constexpr int kWarpsPerBlock = 8;
constexpr int kVec = vec::kWidth;  // bf16 per 16-byte load

template <int M, typename TC>
__global__ void __launch_bounds__(kWarp* kWarpsPerBlock)
    gemv_kernel(const __nv_bfloat16* __restrict__ a, int64_t lda, const __nv_bfloat16* __restrict__ b, int64_t ldb,
                int64_t n, int64_t k, float alpha, float beta, TC* __restrict__ c, int64_t ldc) {
  const int lane = threadIdx.x % kWarp;
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
  if (j >= n) return;  // whole warps leave together
  const __nv_bfloat16* brow = b + j * ldb;
  float acc[M] = {};
  for (int64_t v = lane; v < k / kVec; v += kWarp) {
    float w[kVec];
    vec::load8(brow + v * kVec, w);
#pragma unroll
    for (int r = 0; r < M; ++r) {
      float x[kVec];
      vec::load8(a + r * lda + v * kVec, x);
#pragma unroll
      for (int i = 0; i < kVec; ++i) acc[r] = fmaf(x[i], w[i], acc[r]);
    }
  }
#pragma unroll
  for (int r = 0; r < M; ++r) {
#pragma unroll
    for (int offset = kWarp / 2; offset > 0; offset /= 2) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], offset);
  }
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < M; ++r) {
      TC* out = c + r * ldc + j;
      vec::from_f32(beta == 0.0f ? alpha * acc[r] : alpha * acc[r] + beta * vec::to_f32(*out), out);
    }
  }
}

template <typename TC>
void launch(int64_t m, int64_t n, int64_t k, float alpha, const void* a, int64_t lda, const void* b, int64_t ldb,
            float beta, void* c, int64_t ldc) {
  const auto* ap = static_cast<const __nv_bfloat16*>(a);
  const auto* bp = static_cast<const __nv_bfloat16*>(b);
  auto* cp = static_cast<TC*>(c);
  const unsigned grid = static_cast<unsigned>((n + kWarpsPerBlock - 1) / kWarpsPerBlock);
  const dim3 block(kWarp * kWarpsPerBlock);
  switch (m) {
#define KILN_GEMV_CASE(M) \
  case M: gemv_kernel<M, TC><<<grid, block, 0, stream()>>>(ap, lda, bp, ldb, n, k, alpha, beta, cp, ldc); break;
    KILN_GEMV_CASE(1)
    KILN_GEMV_CASE(2)
    KILN_GEMV_CASE(3)
    KILN_GEMV_CASE(4)
    KILN_GEMV_CASE(5)
    KILN_GEMV_CASE(6)
    KILN_GEMV_CASE(7)
    KILN_GEMV_CASE(8)
#undef KILN_GEMV_CASE
  }
  check_launch("gemm", "gemv_kernel");
}

}  // namespace

bool try_skinny_gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const void* a,
                     int64_t lda, const void* b, int64_t ldb, DType ab_dtype, float beta, void* c, int64_t ldc,
                     DType c_dtype) {
  if (trans_a || !trans_b || ab_dtype != DType::bf16 || m < 1 || m > kMaxSkinnyRows) return false;
  if (c_dtype != DType::bf16 && c_dtype != DType::f32) return false;
  if (k % kVec != 0 || lda % kVec != 0 || ldb % kVec != 0 || !vec::aligned16(a) || !vec::aligned16(b)) return false;
  if (n > int64_t{kWarpsPerBlock} * 0x7fffffff) return false;
  if (c_dtype == DType::f32)
    launch<float>(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  else
    launch<__nv_bfloat16>(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  return true;
}

}  // namespace kiln::cuda

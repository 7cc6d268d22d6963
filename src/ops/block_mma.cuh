// Matrix products computed by a whole thread block over fp32 tiles in shared or global
// memory: C [M, N] = alpha op(A) [M, K] op(B) [K, N] + beta C, where op() reads a tile as
// stored (row-major) or as its transpose. The chunked KDA kernels' chunk products (64-row
// tiles against d_k / d_v columns) were fp32 SIMT loops bound by their shared-memory loads;
// this runs them on the tensor cores.
//
// Two engines with one signature, chosen by the caller at compile time:
//  - tf32: wmma m16n16k8 (sm_80 and later), operands rounded to TF32 (10 mantissa bits), fp32
//    accumulation. M and N multiples of 16, K of 8; every leading dimension a multiple of 4
//    floats and every tile 32-byte aligned (wmma's rules). A warp takes one 16 x 16 output
//    tile at a time, the tiles dealt round the block's warps.
//  - simt: the same product in fp32, a thread per output element summing over k in order:
//    any sizes. The fp32 kernels keep it (their tests hold fp32's bars).
// Every thread of the block calls either; the caller synchronizes before (the operands
// written) and after (C read). C must not overlap A or B.
#pragma once

#include <mma.h>

#include <type_traits>

namespace kiln::cuda::block_mma {

// How an operand is stored: as the [rows, cols] tile it is in the product, or transposed
// (a [cols, rows] row-major tile read as its transpose).
enum class Layout { rows, transposed };

enum class Engine { simt, tf32 };

// Element (r, c) of op(X), X stored with leading dimension ld.
template <Layout L>
__device__ __forceinline__ const float* element(const float* x, int ld, int r, int c) {
  return L == Layout::rows ? x + r * ld + c : x + c * ld + r;
}

template <Layout LA, Layout LB>
__device__ void product_simt(int M, int N, int K, float alpha, const float* A, int lda, const float* B, int ldb,
                             float beta, float* C, int ldc) {
  for (int e = threadIdx.x; e < M * N; e += blockDim.x) {
    const int r = e / N, c = e % N;
    float acc = 0.f;
    for (int k = 0; k < K; ++k) acc += *element<LA>(A, lda, r, k) * *element<LB>(B, ldb, k, c);
    float* out = C + r * ldc + c;
    *out = beta == 0.f ? alpha * acc : alpha * acc + beta * *out;
  }
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
// TF32 wmma needs sm_80; older cards take the SIMT product.
template <Layout LA, Layout LB>
__device__ void product_tf32(int M, int N, int K, float alpha, const float* A, int lda, const float* B, int ldb,
                             float beta, float* C, int ldc) {
  product_simt<LA, LB>(M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}
#else
template <Layout L>
using WmmaLayout = std::conditional_t<L == Layout::rows, nvcuda::wmma::row_major, nvcuda::wmma::col_major>;

template <Layout LA, Layout LB>
__device__ void product_tf32(int M, int N, int K, float alpha, const float* A, int lda, const float* B, int ldb,
                             float beta, float* C, int ldc) {
  namespace wmma = nvcuda::wmma;
  using Accumulator = wmma::fragment<wmma::accumulator, 16, 16, 8, float>;
  const int warp = threadIdx.x / 32, warps = blockDim.x / 32, tiles_n = N / 16;
  for (int t = warp; t < M / 16 * tiles_n; t += warps) {
    const int m0 = t / tiles_n * 16, n0 = t % tiles_n * 16;
    Accumulator acc;
    wmma::fill_fragment(acc, 0.f);
    for (int k0 = 0; k0 < K; k0 += 8) {
      wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, WmmaLayout<LA>> a;
      wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, WmmaLayout<LB>> b;
      wmma::load_matrix_sync(a, element<LA>(A, lda, m0, k0), lda);
      wmma::load_matrix_sync(b, element<LB>(B, ldb, k0, n0), ldb);
#pragma unroll
      for (int i = 0; i < a.num_elements; ++i) a.x[i] = wmma::__float_to_tf32(a.x[i]);
#pragma unroll
      for (int i = 0; i < b.num_elements; ++i) b.x[i] = wmma::__float_to_tf32(b.x[i]);
      wmma::mma_sync(acc, a, b, acc);
    }
    float* out = C + m0 * ldc + n0;
    if (beta != 0.f) {
      Accumulator old;  // the same fragment type, so element i of both is the same (r, c)
      wmma::load_matrix_sync(old, out, ldc, wmma::mem_row_major);
#pragma unroll
      for (int i = 0; i < acc.num_elements; ++i) acc.x[i] = alpha * acc.x[i] + beta * old.x[i];
    } else {
#pragma unroll
      for (int i = 0; i < acc.num_elements; ++i) acc.x[i] *= alpha;
    }
    wmma::store_matrix_sync(out, acc, ldc, wmma::mem_row_major);
  }
}
#endif

template <Engine E, Layout LA, Layout LB>
__device__ void product(int M, int N, int K, float alpha, const float* A, int lda, const float* B, int ldb, float beta,
                        float* C, int ldc) {
  if constexpr (E == Engine::tf32)
    product_tf32<LA, LB>(M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  else
    product_simt<LA, LB>(M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

// n rounded up to the tf32 engine's tile side.
__host__ __device__ constexpr int round16(int n) { return (n + 15) / 16 * 16; }

}  // namespace kiln::cuda::block_mma

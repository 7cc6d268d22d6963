// Chunked KDA: the pairwise gradients of the grads kernels (kda_chunked_backward.cu), a
// thread per element in fp32 (pairwise_gradient) and with the sums off the diagonal blocks on
// the tensor cores (pairwise_gradient_tf32).
#pragma once

#include "ops/kda/kda_chunked_common.cuh"

namespace kiln::cuda::kda_chunked {

// The gradient of a pairwise form F_rc = sum_i a_r[i] b_c[i] exp(G_r[i] - G_c[i]) (c < r, and
// c = r with `diagonal`) whose upstream gradient is dF_rc = weight(r) pm[r][c]:
//   ga[r] += sum_c dF_rc b_c e_rc,   gb[c] += sum_r dF_rc a_r e_rc,
//   gc[r] += a_r (ga's sum without c = r),   gc[c] -= b_c (gb's sum without r = c)
// (d e_rc / dG_r = e_rc, d e_rc / dG_c = -e_rc; the diagonal's exponent is 0). A thread per
// element (r, i) of the [len, d_k] tiles sums both its row's and its column's terms in
// registers: every thread of the block works, and each alone writes its element (the same
// element of ga, gb and gc in both sums, so a = b, ga = gb is allowed). e_rc is computed
// twice (once per side) so that no element is written by two threads. It replaced a thread
// per channel (half the block idle, a shared read-modify-write per pair); with it and the
// staging and row reuse below, `grads` went from 31.0 to 16.4 ms a call at K3's 8 x 4096 on
// an H100 (docs/performance.md).
template <typename RowA, typename RowB, typename Weight>
__device__ void pairwise_gradient(int64_t len, int64_t dk, const float* cum, const float* pm, bool diagonal, RowA a,
                                  RowB b, Weight weight, float* ga, float* gb, float* gc) {
  for (int64_t e = threadIdx.x; e < len * dk; e += blockDim.x) {
    const int64_t n = e / dk, i = e % dk;
    const float gn = cum[e];
    float row = 0.f;  // n as the row r: sum over c < n
    for (int64_t col = 0; col < n; ++col) row += pm[n * kC + col] * b(col, i) * expf(gn - cum[col * dk + i]);
    row *= weight(n);
    float column = 0.f;  // n as the column c: sum over r > n
    for (int64_t r = n + 1; r < len; ++r) column += weight(r) * pm[r * kC + n] * a(r, i) * expf(cum[r * dk + i] - gn);
    const float an = a(n, i), bn = b(n, i);
    const float diag = diagonal ? weight(n) * pm[n * kC + n] : 0.f;
    ga[e] += row + diag * bn;
    gb[e] += column + diag * an;
    gc[e] += an * row - bn * column;
  }
}

// ---- the pairwise gradients on the tensor cores (grads_tf32_kernel) ----------------------
// pairwise_gradient's sums split by prepare_tf32_kernel's 16-row sub-chunks. A row r of
// sub-chunk a > 0 meets the columns c of the sub-chunks before it through the reference row
// 16 a (c < 16 a <= r):
//   row sum   R_r  = exp(G_r - G_16a) sum_{c < 16a} dF'_rc (b_c exp(G_16a - G_c)),
// a column c of sub-chunk b < 3 the rows of the sub-chunks after it through 16 (b + 1):
//   column sum C_c = exp(G_16(b+1) - G_c) sum_{r >= 16(b+1)} dF'_rc (weight(r) a_r exp(G_r - G_16(b+1)))
// (dF' = pm, the weight(r) of the row sums applied with the diagonal blocks' terms). Every
// exponent is <= 0, as in prepare: no overflow, and a factor underflowing to 0 stands for a
// smaller product. So each boundary m = 1..3 stages two tiles per channel: X_m (rows c <
// 16 m, b_c exp(G_16m - G_c)) and Y_m (rows r >= 16 m, weight(r) a_r exp(G_r - G_16m)), and
// the sums are six products, [16, 16 m] pm blocks against X_m (R of sub-chunk m) and their
// transposes [16, 64 - 16 m] against Y_m (C of sub-chunk m - 1): one factor per row or
// column after them. The 16 x 16 diagonal blocks keep pairwise_gradient's exact per-channel
// terms (15 pairs an element instead of up to 63). Channels go kSlab at a time.
constexpr int kSlab = 32;
constexpr int kSlabLd = kSlab + 4;  // a multiple of 4 floats, as wmma's leading dimensions
constexpr int kBoundaryRows = kSub * (1 + 2 + 3);  // X_1..X_3, and as many in Y_1..Y_3: 96
// X, Y, then the sums: R of rows 16..63 (at row r - 16) and C of rows 0..47 (at 48 + c).
constexpr int kSumsFirst = 2 * kBoundaryRows;
constexpr int kPairStage = (kSumsFirst + 2 * (kC - kSub)) * kSlabLd;  // floats
static_assert(kSubs == 4 && kBoundaryRows == 2 * (kC - kSub), "the sums' rows follow X and Y's");

// The first staged row of X_m and of Y_m (m = 1..3): X_m has 16 m rows, Y_m 64 - 16 m.
__host__ __device__ constexpr int x_first(int m) { return kSub * m * (m - 1) / 2; }
__host__ __device__ constexpr int y_first(int m) { return kBoundaryRows + (m - 1) * kC - x_first(m); }
static_assert(x_first(4) == kBoundaryRows && y_first(4) == 2 * kBoundaryRows);

// C [16, 16] = op(A) [16, K] B [K, 16] (B row-major) by one warp, TF32 with fp32
// accumulation (K a multiple of 8; leading dimensions and tiles as block_mma's rules).
template <Layout LA>
__device__ void warp_tile_tf32(int K, const float* A, int lda, const float* B, int ldb, float* C, int ldc) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  for (int e = threadIdx.x % 32; e < kSub * kSub; e += 32) {  // no TF32 wmma: fp32 lanes
    const int r = e / kSub, col = e % kSub;
    float acc = 0.f;
    for (int k = 0; k < K; ++k) acc += *block_mma::element<LA>(A, lda, r, k) * B[k * ldb + col];
    C[r * ldc + col] = acc;
  }
#else
  namespace wmma = nvcuda::wmma;
  wmma::fragment<wmma::accumulator, 16, 16, 8, float> acc;
  wmma::fill_fragment(acc, 0.f);
  for (int k0 = 0; k0 < K; k0 += 8) {
    wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, block_mma::WmmaLayout<LA>> a;
    wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::row_major> b;
    wmma::load_matrix_sync(a, block_mma::element<LA>(A, lda, 0, k0), lda);
    wmma::load_matrix_sync(b, B + k0 * ldb, ldb);
#pragma unroll
    for (int n = 0; n < a.num_elements; ++n) a.x[n] = wmma::__float_to_tf32(a.x[n]);
#pragma unroll
    for (int n = 0; n < b.num_elements; ++n) b.x[n] = wmma::__float_to_tf32(b.x[n]);
    wmma::mma_sync(acc, a, b, acc);
  }
  wmma::store_matrix_sync(C, acc, ldc, wmma::mem_row_major);
#endif
}

// pairwise_gradient (the same arguments and result) with the sums off the diagonal blocks on
// the tensor cores; `stage` holds kPairStage floats, 32-byte aligned. pm's blocks below the
// diagonal must be zero in rows past len (they are: dP's dO rows and dL are zeroed there);
// the staged rows past len are written as zero, and so is a boundary's X_m when its row 16 m
// is past len (G is stale there: its rows' sums are not used). Every thread of the block
// calls it; it starts by reading what the block wrote before a barrier and ends synced (its
// threads own other elements than pairwise_gradient's).
template <typename RowA, typename RowB, typename Weight>
__device__ void pairwise_gradient_tf32(int64_t len, int64_t dk, const float* cum, const float* pm, bool diagonal,
                                       RowA a, RowB b, Weight weight, float* ga, float* gb, float* gc, float* stage) {
  const int warp = threadIdx.x / 32, warps = blockDim.x / 32;
  float* sums = stage + kSumsFirst * kSlabLd;
  for (int64_t i0 = 0; i0 < dk; i0 += kSlab) {
    const int width = dk - i0 < kSlab ? static_cast<int>(dk - i0) : kSlab;  // 16 or 32: d_k % 16 == 0
    // X_m and Y_m for channels i0..i0 + width.
    for (int e = threadIdx.x; e < kSumsFirst * width; e += blockDim.x) {
      const int rho = e / width, i = static_cast<int>(i0) + e % width;
      float x = 0.f;
      if (rho < kBoundaryRows) {
        const int m = rho < x_first(2) ? 1 : rho < x_first(3) ? 2 : 3, col = rho - x_first(m), ref = kSub * m;
        if (ref < len) x = b(col, i) * expf(cum[ref * dk + i] - cum[col * dk + i]);
      } else {
        const int m = rho < y_first(2) ? 1 : rho < y_first(3) ? 2 : 3, r = kSub * m + rho - y_first(m);
        if (r < len) x = weight(r) * a(r, i) * expf(cum[r * dk + i] - cum[kSub * m * dk + i]);
      }
      stage[rho * kSlabLd + e % width] = x;
    }
    __syncthreads();
    // Six products a column tile of 16 channels: job m - 1 the row sums of sub-chunk m, job
    // m + 2 the column sums of sub-chunk m - 1.
    const int tiles = width / kSub;
    for (int t = warp; t < 2 * (kSubs - 1) * tiles; t += warps) {
      const int job = t / tiles, n0 = kSub * (t % tiles);
      if (job < kSubs - 1) {
        const int m = job + 1;
        warp_tile_tf32<Layout::rows>(kSub * m, pm + kSub * m * kC, kC, stage + x_first(m) * kSlabLd + n0, kSlabLd,
                                     sums + (kSub * m - kSub) * kSlabLd + n0, kSlabLd);
      } else {
        const int m = job - (kSubs - 1) + 1, col0 = kSub * (m - 1);
        warp_tile_tf32<Layout::transposed>(kC - kSub * m, pm + kSub * m * kC + col0, kC,
                                           stage + y_first(m) * kSlabLd + n0, kSlabLd,
                                           sums + (kC - kSub + col0) * kSlabLd + n0, kSlabLd);
      }
    }
    __syncthreads();
    // Per element (n, i): the sums' factors, the diagonal block's exact terms, then
    // pairwise_gradient's updates. The next slab's staging writes only X and Y, its products
    // (the sums) only after the barrier above them, so no barrier here.
    for (int64_t e = threadIdx.x; e < len * width; e += blockDim.x) {
      const int64_t n = e / width, j = e % width, i = i0 + j, at = n * dk + i;
      const int64_t first = n / kSub * kSub, next = first + kSub;
      const float gn = cum[at];
      float row = first > 0 ? expf(gn - cum[first * dk + i]) * sums[(n - kSub) * kSlabLd + j] : 0.f;
      for (int64_t col = first; col < n; ++col) row += pm[n * kC + col] * b(col, i) * expf(gn - cum[col * dk + i]);
      row *= weight(n);
      float column = next < len ? expf(cum[next * dk + i] - gn) * sums[(kC - kSub + n) * kSlabLd + j] : 0.f;
      for (int64_t r = n + 1; r < next && r < len; ++r)
        column += weight(r) * pm[r * kC + n] * a(r, i) * expf(cum[r * dk + i] - gn);
      const float an = a(n, i), bn = b(n, i);
      const float diag = diagonal ? weight(n) * pm[n * kC + n] : 0.f;
      ga[at] += row + diag * bn;
      gb[at] += column + diag * an;
      gc[at] += an * row - bn * column;
    }
  }
  __syncthreads();
}

}  // namespace kiln::cuda::kda_chunked

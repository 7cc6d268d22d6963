// Chunked KDA: the prepare kernels (G, A, P, M, U, W of every chunk; the overview is
// kda_chunked_common.cuh's), in fp32 SIMT (prepare_kernel) and on the tensor cores
// (prepare_tf32_kernel), and their launch.
#include "ops/kda/kda_chunked_common.cuh"

namespace kiln::cuda::kda_chunked {

namespace {

// Shared: cum [C, d_k], A [C, C], M [C, C], beta [C].
template <typename T>
__global__ void __launch_bounds__(kThreads) prepare_kernel(KdaArgs s, Tiles w, const T* q, const T* k, const T* v,
                                                           const T* g, const T* beta) {
  extern __shared__ float sm[];
  Chunk c;
  if (!locate(s, blockIdx.x, c)) return;
  const int64_t h = blockIdx.y, H = s.heads, dk = s.dk, dv = s.dv, len = c.len;
  const int64_t at = c.slot * H + h;
  float* cum = sm;
  float* A = cum + kC * dk;
  float* M = A + kC * kC;
  float* bt = M + kC * kC;
  cumulative_decay(dk, rows_of(g, s, c, h, dk), len, cum, dk);
  for (int64_t r = threadIdx.x; r < kC; r += blockDim.x) bt[r] = r < len ? to_f32(beta[(c.first + r) * H + h]) : 0.f;
  __syncthreads();
  // A (s < r) and P (s <= r); zero elsewhere. A warp per pair.
  const WarpPairs pairs;
  for (int64_t e = pairs.first; e < kC * kC; e += pairs.step) {
    const int64_t r = e / kC, col = e % kC;
    float a = 0.f, p = 0.f;
    if (r < len && col <= r) {
      const T* kr = k + ((c.first + r) * H + h) * dk;
      const T* ks = k + ((c.first + col) * H + h) * dk;
      const T* qr = q + ((c.first + r) * H + h) * dk;
      for (int64_t i = pairs.lane; i < dk; i += 32) {
        const float decayed = to_f32(ks[i]) * expf(cum[r * dk + i] - cum[col * dk + i]);
        a += to_f32(kr[i]) * decayed;
        p += to_f32(qr[i]) * decayed;
      }
      a = col == r ? 0.f : warp_sum(a);
      p = warp_sum(p);
    }
    if (pairs.lane == 0) {
      A[e] = a;
      w.A[at * w.cc + e] = a;
      w.P[at * w.cc + e] = p;
      M[e] = r == col && r < len ? 1.f : 0.f;
    }
  }
  __syncthreads();
  // M = (I + L)^-1 by forward substitution, a row at a time: M_rc = -sum_{c<=m<r} L_rm M_mc.
  for (int64_t r = 1; r < len; ++r) {
    for (int64_t col = threadIdx.x; col < r; col += blockDim.x) {
      float acc = 0.f;
      for (int64_t m = col; m < r; ++m) acc += A[r * kC + m] * M[m * kC + col];
      M[r * kC + col] = -bt[r] * acc;
    }
    __syncthreads();
  }
  for (int64_t e = threadIdx.x; e < kC * kC; e += blockDim.x) w.M[at * w.cc + e] = M[e];
  // U = M Diag(beta) V, W = M Diag(beta) Gamma K.
  for (int64_t e = threadIdx.x; e < len * dv; e += blockDim.x) {
    const int64_t r = e / dv, j = e % dv;
    float acc = 0.f;
    for (int64_t col = 0; col <= r; ++col) acc += M[r * kC + col] * bt[col] * to_f32(v[((c.first + col) * H + h) * dv + j]);
    w.U[at * w.cv + r * dv + j] = acc;
  }
  // cum becomes Diag(beta) Gamma K in place (an exp per element, not per product).
  for (int64_t e = threadIdx.x; e < len * dk; e += blockDim.x)
    cum[e] = bt[e / dk] * expf(cum[e]) * to_f32(k[(c.first + e / dk) * H * dk + h * dk + e % dk]);
  __syncthreads();
  for (int64_t e = threadIdx.x; e < len * dk; e += blockDim.x) {
    const int64_t r = e / dk, i = e % dk;
    float acc = 0.f;
    for (int64_t col = 0; col <= r; ++col) acc += M[r * kC + col] * cum[col * dk + i];
    w.W[at * w.ck + r * dk + i] = acc;
  }
}

// ---- prepare on the tensor cores (Engine::tf32) ---------------------------------------------
//
// A and P by sub-chunks (flash-linear-attention's chunk_kda intra-chunk form): the chunk's
// rows fall in four sub-chunks of 16. A block below the diagonal (rows of sub-chunk a, columns
// of b < a) factors the pairwise decay through the reference row ref = 16 a, whose G lies
// between theirs (G is non-increasing along the rows):
//   A_ab = (K_a exp(G_a - G_ref)) (K_b exp(G_ref - G_b))^T,  P_ab likewise with Q_a,
// both exponents <= 0 (no overflow; a factor underflowing to 0 stands for a product smaller
// still), so each is a [16, d_k] x [d_k, 16] product on the tensor cores. The four diagonal
// blocks keep the exact per-channel exp(G_r - G_s) of prepare_kernel.

// The six blocks below the diagonal, p = 0..5: (a, b) = (1,0) (2,0) (2,1) (3,0) (3,1) (3,2).
__device__ __forceinline__ int pair_row(int p) { return p < 1 ? 1 : p < 3 ? 2 : 3; }
__device__ __forceinline__ int pair_col(int p) { return p - pair_row(p) * (pair_row(p) - 1) / 2; }

constexpr int kPairs = 6;             // blocks below the diagonal
constexpr int kStageCols = 16;        // d_k channels staged per step
constexpr int kStageLd = kStageCols + 4;
// Staged rows per step: K_a and Q_a with their row factors (rows 16..63 each), then K_b with
// each pair's column factor.
constexpr int kStageRows = 2 * (kC - kSub) + kPairs * kSub;  // 192
static_assert(kSubs * kSub == kC && kSubs * (kSubs - 1) / 2 == kPairs);
static_assert(kStageRows * kStageLd <= kC * kC, "the staging area is M's");

// Staged row rho's element (rho, i) for channels i0.. (cum: G, rows gld apart). Rows past
// len are zero (their G is stale), as are a pair's column rows when its reference row is.
template <typename T>
__device__ float staged_factor(int rho, int64_t i, const float* cum, int64_t gld, Rows<T> q, Rows<T> k, int64_t len) {
  if (rho < 2 * (kC - kSub)) {
    const int r = kSub + rho % (kC - kSub), ref = r / kSub * kSub;
    if (r >= len) return 0.f;
    const float x = rho < kC - kSub ? k.at(r, i) : q.at(r, i);
    return x * expf(cum[r * gld + i] - cum[ref * gld + i]);
  }
  const int p = (rho - 2 * (kC - kSub)) / kSub, t = rho % kSub;
  const int ref = kSub * pair_row(p), col = kSub * pair_col(p) + t;
  if (ref >= len) return 0.f;  // then col < ref is not past len, but the whole block is
  return k.at(col, i) * expf(cum[ref * gld + i] - cum[col * gld + i]);
}

// The blocks of A and P below the diagonal: A's into the shared A [C, C], P's into the
// workspace's tile. Warp p < 6 takes pair p, keeping its A and P blocks in registers over
// d_k, staged kStageCols channels at a time in `stage`. Every thread of the block calls it.
template <typename T>
__device__ void off_diagonal_blocks(int64_t dk, const float* cum, int64_t gld, Rows<T> q, Rows<T> k, int64_t len,
                                    float* stage, float* A, float* P_tile) {
  const int warp = threadIdx.x / 32;
  [[maybe_unused]] const int lane = threadIdx.x % 32;  // the pre-sm_80 loops'
  const int p = warp < kPairs ? warp : 0, a = pair_row(p), b = pair_col(p);  // warps past 5 only stage
  const float* ka = stage + (a - 1) * kSub * kStageLd;
  const float* qa = ka + (kC - kSub) * kStageLd;
  const float* kb = stage + (2 * (kC - kSub) + p * kSub) * kStageLd;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  // No TF32 wmma before sm_80: each lane of the warp sums 8 elements of the two blocks.
  float acc_a[8] = {}, acc_p[8] = {};
#else
  namespace wmma = nvcuda::wmma;
  wmma::fragment<wmma::accumulator, 16, 16, 8, float> acc_a, acc_p;
  wmma::fill_fragment(acc_a, 0.f);
  wmma::fill_fragment(acc_p, 0.f);
#endif
  for (int64_t i0 = 0; i0 < dk; i0 += kStageCols) {
    for (int e = threadIdx.x; e < kStageRows * kStageCols; e += blockDim.x) {
      const int rho = e / kStageCols, i = e % kStageCols;
      stage[rho * kStageLd + i] = staged_factor(rho, i0 + i, cum, gld, q, k, len);
    }
    __syncthreads();
    if (warp < kPairs) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
      for (int n = 0; n < 8; ++n) {
        const int t = (lane * 8 + n) / kSub, col = (lane * 8 + n) % kSub;
        for (int i = 0; i < kStageCols; ++i) {
          acc_a[n] += ka[t * kStageLd + i] * kb[col * kStageLd + i];
          acc_p[n] += qa[t * kStageLd + i] * kb[col * kStageLd + i];
        }
      }
#else
      for (int k0 = 0; k0 < kStageCols; k0 += 8) {
        wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::row_major> fk, fq;
        wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::col_major> fb;  // K_b^T
        wmma::load_matrix_sync(fk, ka + k0, kStageLd);
        wmma::load_matrix_sync(fq, qa + k0, kStageLd);
        wmma::load_matrix_sync(fb, kb + k0, kStageLd);
#pragma unroll
        for (int n = 0; n < fk.num_elements; ++n) {
          fk.x[n] = wmma::__float_to_tf32(fk.x[n]);
          fq.x[n] = wmma::__float_to_tf32(fq.x[n]);
        }
#pragma unroll
        for (int n = 0; n < fb.num_elements; ++n) fb.x[n] = wmma::__float_to_tf32(fb.x[n]);
        wmma::mma_sync(acc_a, fk, fb, acc_a);
        wmma::mma_sync(acc_p, fq, fb, acc_p);
      }
#endif
    }
    __syncthreads();  // the next step overwrites the stage
  }
  if (warp >= kPairs) return;
  const int64_t at = kSub * a * kC + kSub * b;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  for (int n = 0; n < 8; ++n) {
    const int t = (lane * 8 + n) / kSub, col = (lane * 8 + n) % kSub;
    A[at + t * kC + col] = acc_a[n];
    P_tile[at + t * kC + col] = acc_p[n];
  }
#else
  wmma::store_matrix_sync(A + at, acc_a, kC, wmma::mem_row_major);
  wmma::store_matrix_sync(P_tile + at, acc_p, kC, wmma::mem_row_major);
#endif
}

// M = (I + L)^-1, L = Diag(beta) strictly_lower(A), by blocks of 16: the four diagonal blocks
// by forward substitution (a warp each, a lane per column), then the blocks below them by
// distance from the diagonal, M_ab = -M_aa X_ab with X_ab = sum_{b<=m<a} L_am M_mb (L M = I,
// block row a, column b; the blocks of M it reads are nearer the diagonal). X_ab lies in the
// shared A's block (b, a), above the diagonal and unused (A is in the workspace by then).
// Rows past len: beta is zero there, and M's diagonal is set to zero, so M's rows and
// columns past len are zero, as prepare_kernel's. Every thread calls it; it ends synced.
__device__ void blocked_inverse(float* A, const float* bt, int64_t len, float* M) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp < kSubs && lane < kSub) {
    const int d0 = warp * kSub, col = d0 + lane;
    for (int r = d0; r < d0 + kSub; ++r) {
      float acc = 0.f;
      for (int m = col; m < r; ++m) acc += A[r * kC + m] * M[m * kC + col];
      M[r * kC + col] = r == col ? (r < len ? 1.f : 0.f) : r > col ? -bt[r] * acc : 0.f;
      __syncwarp(0xffffu);  // row r read by the lanes' next rows
    }
  }
  // The blocks above the diagonal are zero (in M; A's hold the X blocks).
  for (int e = threadIdx.x; e < kC * kC; e += blockDim.x)
    if (e % kC / kSub > e / kC / kSub) M[e] = 0.f;
  __syncthreads();
  for (int distance = 1; distance < kSubs; ++distance) {
    const int blocks = kSubs - distance;
    for (int e = threadIdx.x; e < blocks * kSub * kSub; e += blockDim.x) {
      const int b = e / (kSub * kSub), a = b + distance, t = e / kSub % kSub, u = e % kSub;
      const int r = a * kSub + t, col = b * kSub + u;
      float acc = 0.f;
      for (int m = b * kSub; m < a * kSub; ++m) acc += A[r * kC + m] * M[m * kC + col];
      A[(b * kSub + t) * kC + a * kSub + u] = bt[r] * acc;  // X_ab (t, u)
    }
    __syncthreads();
    for (int e = threadIdx.x; e < blocks * kSub * kSub; e += blockDim.x) {
      const int b = e / (kSub * kSub), a = b + distance, t = e / kSub % kSub, u = e % kSub;
      const int r = a * kSub + t;
      float acc = 0.f;
      for (int m = 0; m <= t; ++m) acc += M[r * kC + a * kSub + m] * A[(b * kSub + m) * kC + a * kSub + u];
      M[r * kC + b * kSub + u] = -acc;
    }
    __syncthreads();
  }
}

// prepare_kernel with Engine::tf32: A's and P's blocks below the diagonal and the products
// U = M Diag(beta) V, W = M (Diag(beta) Gamma K) on the tensor cores, M by blocks. Shared:
// cum [C, d_k] (rows d_k + 4 apart: G, then Diag(beta) Gamma K), A [C, C], M [C, C] (the
// staging of A's and P's factors before M), beta [C]; for U, Diag(beta) V in column slices
// over cum and A. Every tile is written for all C rows, zero past len (the tensor cores of
// the later kernels read whole tiles). Qg only with QueryTiles: state_grads_tf32_kernel, in
// the backward, is its only reader.
template <typename T, bool QueryTiles>
__global__ void __launch_bounds__(kThreads) prepare_tf32_kernel(KdaArgs s, Tiles w, const T* q, const T* k,
                                                                const T* v, const T* g, const T* beta) {
  using block_mma::product;
  extern __shared__ float sm[];
  Chunk c;
  if (!locate(s, blockIdx.x, c)) return;
  const int64_t h = blockIdx.y, H = s.heads, dk = s.dk, dv = s.dv, len = c.len;
  const int64_t at = c.slot * H + h, gld = dk + 4;
  float* cum = sm;
  float* A = cum + kC * gld;
  float* M = A + kC * kC;
  float* bt = M + kC * kC;
  float* P = w.P + at * w.cc;
  const Rows<T> q_rows = rows_of(q, s, c, h, dk), k_rows = rows_of(k, s, c, h, dk);
  cumulative_decay(dk, rows_of(g, s, c, h, dk), len, cum, gld);
  for (int64_t r = threadIdx.x; r < kC; r += blockDim.x) bt[r] = r < len ? to_f32(beta[(c.first + r) * H + h]) : 0.f;
  __syncthreads();
  // The diagonal blocks, a warp per pair as prepare_kernel (zero above the diagonal and past
  // len), and the blocks above the diagonal (zero).
  const WarpPairs pairs;
  for (int64_t e = pairs.first; e < kSubs * kSub * kSub; e += pairs.step) {
    const int64_t d0 = e / (kSub * kSub) * kSub, r = d0 + e / kSub % kSub, col = d0 + e % kSub;
    float a = 0.f, p = 0.f;
    if (r < len && col <= r) {
      for (int64_t i = pairs.lane; i < dk; i += 32) {
        const float decayed = k_rows.at(col, i) * expf(cum[r * gld + i] - cum[col * gld + i]);
        a += k_rows.at(r, i) * decayed;
        p += q_rows.at(r, i) * decayed;
      }
      a = col == r ? 0.f : warp_sum(a);
      p = warp_sum(p);
    }
    if (pairs.lane == 0) {
      A[r * kC + col] = a;
      P[r * kC + col] = p;
    }
  }
  for (int64_t e = threadIdx.x; e < kC * kC; e += blockDim.x)
    if (e % kC / kSub > e / kC / kSub) A[e] = P[e] = 0.f;
  off_diagonal_blocks(dk, cum, gld, q_rows, k_rows, len, M, A, P);
  __syncthreads();
  for (int64_t e = threadIdx.x; e < kC * kC; e += blockDim.x) w.A[at * w.cc + e] = A[e];
  // The sequential kernels' decayed keys and queries, as decayed_keys forms them (each of
  // their blocks did, per slice of the state), and exp(G_last).
  for (int64_t e = threadIdx.x; e < kC * dk; e += blockDim.x) {
    const int64_t r = e / dk, i = e % dk;
    const float G = cum[r * gld + i], last = cum[(len - 1) * gld + i];
    w.Kd[at * w.ck + e] = r < len ? expf(last - G) * k_rows.at(r, i) : 0.f;
    if constexpr (QueryTiles) w.Qg[at * w.ck + e] = r < len ? expf(G) * q_rows.at(r, i) : 0.f;
  }
  for (int64_t i = threadIdx.x; i < dk; i += blockDim.x) w.El[at * dk + i] = expf(cum[(len - 1) * gld + i]);
  __syncthreads();  // G read before it is overwritten
  // cum becomes Diag(beta) Gamma K in place, zero past len (W's product sums over its rows).
  for (int64_t e = threadIdx.x; e < kC * dk; e += blockDim.x) {
    const int64_t r = e / dk, i = e % dk;
    float& x = cum[r * gld + i];
    x = r < len ? bt[r] * expf(x) * k_rows.at(r, i) : 0.f;
  }
  blocked_inverse(A, bt, len, M);
  for (int64_t e = threadIdx.x; e < kC * kC; e += blockDim.x) w.M[at * w.cc + e] = M[e];
  product<Engine::tf32, Layout::rows, Layout::rows>(kC, dk, kC, 1.f, M, kC, cum, gld, 0.f, w.W + at * w.ck, dk);
  // U by column slices of Diag(beta) V, staged over cum and A (contiguous).
  const int64_t width = dk + kC;  // fits cum's and A's floats with rows 4 longer
  for (int64_t j0 = 0; j0 < dv; j0 += width) {
    const int64_t n = dv - j0 < width ? dv - j0 : width, vld = n + 4;
    __syncthreads();  // cum (or the previous slice) read
    for (int64_t e = threadIdx.x; e < kC * n; e += blockDim.x) {
      const int64_t r = e / n, j = e % n;
      cum[r * vld + j] = r < len ? bt[r] * to_f32(v[((c.first + r) * H + h) * dv + j0 + j]) : 0.f;
    }
    __syncthreads();
    product<Engine::tf32, Layout::rows, Layout::rows>(kC, n, kC, 1.f, M, kC, cum, vld, 0.f, w.U + at * w.cv + j0,
                                                      dv);
  }
}

}  // namespace

template <typename T>
void prepare_launch(const ExecContext& ctx, const KdaArgs& a, const Tiles& w, const T* q, const T* k, const T* v,
                    const T* g, const T* beta, bool query_tiles, const char* op) {
  [&] {
    if constexpr (std::is_same_v<T, bf16>)
      if (engine_of<T>(a) == Engine::tf32) {
        const size_t bytes = floats(kC * (a.dk + 4) + 2 * kC * kC + kC);
        const auto launch = [&]<bool QueryTiles>() {
          allow_shared(prepare_tf32_kernel<T, QueryTiles>, bytes, op);
          prepare_tf32_kernel<T, QueryTiles><<<chunks_grid(a), kThreads, bytes, stream(ctx)>>>(a, w, q, k, v, g, beta);
        };
        if (query_tiles)
          launch.template operator()<true>();
        else
          launch.template operator()<false>();
        return;
      }
    const size_t bytes = floats(kC * a.dk + 2 * kC * kC + kC);
    allow_shared(prepare_kernel<T>, bytes, op);
    prepare_kernel<T><<<chunks_grid(a), kThreads, bytes, stream(ctx)>>>(a, w, q, k, v, g, beta);
  }();
  check_launch(op, "prepare_kernel");
}

template void prepare_launch<float>(const ExecContext&, const KdaArgs&, const Tiles&, const float*, const float*,
                                    const float*, const float*, const float*, bool, const char*);
template void prepare_launch<bf16>(const ExecContext&, const KdaArgs&, const Tiles&, const bf16*, const bf16*,
                                   const bf16*, const bf16*, const bf16*, bool, const char*);

}  // namespace kiln::cuda::kda_chunked

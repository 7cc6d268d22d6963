// Chunked KDA kernels (declared in kda_chunked_cuda.h). The math, term by term, is
// kda_chunked.cpp's header; the names here are its names: per chunk of L <= 64 tokens the
// cumulative log decay G, A (k against k, strictly lower) and P (q against k, lower), both
// with the pairwise decay exp(G_r - G_s) <= 1 taken per channel (never factored into
// exp(G_r) exp(-G_s), which overflows fp32 under strong decays; the tensor cores' prepare
// factors it only through a row between r and s, both factors <= 1: prepare_tf32_kernel),
// M = (I + Diag(beta) A)^-1, U = M Diag(beta) V, W = M Diag(beta) Gamma K, the entering
// state S_0, D = U - W S_0.
//
// Forward:  prepare   one block per (chunk, head), all chunks at once: G, A, P, M, U, W
//                     (with Engine::tf32, A's and P's blocks off the diagonal, U and W on
//                     the tensor cores and M by 16 x 16 blocks: prepare_tf32_kernel).
//           states    one block per (d_v slice, head, document), walking its chunks in
//                     order: S_0 of each chunk and D, then S_0 -> S_L.
//           output    one block per (chunk, head): o = scale (Gamma q S_0 + P D).
// Backward: prepare and states again (nothing is kept from the forward), then
//           state_grads  per (d_v slice, head, document), chunks in reverse: dS at each
//                     chunk's end (dL/dS_L) and dD = scale P^T dO + Kd dS, carrying
//                     dS_0 = Gamma_L dS + scale Qg^T dO - W^T dD to the previous chunk;
//           grads     per (chunk, head): dq, dk, dv, dg, dbeta from S_0, dS, D, dD and the
//                     factors. The pairwise terms run a thread per element (row, channel),
//                     summing that row's and that column's pairs in registers. On the
//                     tensor cores (grads_tf32_kernel) its plain matrix products run by
//                     block_mma: dP, dO S_0, D dS, dW, X_v, X_k and dL; and the pairwise
//                     sums off the 16 x 16 diagonal blocks by prepare's sub-chunk
//                     factoring (pairwise_gradient_tf32), the diagonal blocks per channel.
//
// Chunks are cut per document. A document starting at token b (document index s) owns the
// chunk slots b / 64 + s, b / 64 + s + 1, ... (ceil(L / 64) of them): slots are unique and
// fewer than tokens / 64 + documents, so a per-chunk kernel launches that many blocks
// without reading cu_seqlens back, and each block finds its document by a binary search
// (blocks of unused slots return at once). The workspace holds per (slot, head) the tiles
// below, fp32.
#include "ops/kda/kda_chunked_cuda.h"

#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "core/error.h"
#include "ops/bf16_vector.cuh"
#include "ops/block_mma.cuh"

#include <cuda_bf16.h>
#include <cuda_pipeline.h>

#include <cstdint>
#include <type_traits>

namespace kiln::cuda {

namespace {

using block_mma::Engine;
using block_mma::Layout;
using vec::bf16;
using vec::from_f32;
using vec::to_f32;

constexpr int kC = static_cast<int>(kKdaChunk);
constexpr int kThreads = 256;
// grads fills an SM's shared memory alone (one block per SM), so it takes more threads to
// hide its loads' latency: 16 warps, not 8.
constexpr int kGradsThreads = 512;

int64_t slots_of(int64_t tokens, int64_t num_seqs) { return tokens / kC + num_seqs; }

// The chunk products' engine: TF32 tensor cores for bf16 inputs whose d_k and d_v are
// multiples of 16 (wmma's tile side), unless the caller turned them off
// (KdaArgs::tensor_cores); fp32 SIMT otherwise, so the fp32 inputs keep fp32's accuracy.
template <typename T>
Engine engine_of(const KdaArgs& a) {
  const bool tiles = a.dk % 16 == 0 && a.dv % 16 == 0;
  return std::is_same_v<T, bf16> && a.tensor_cores && tiles ? Engine::tf32 : Engine::simt;
}

// The workspace's tiles, each [slots, H, tile elements].
struct Tiles {
  float *M, *A, *P;          // [C, C]
  float *U, *D, *dD, *Xv;    // [C, d_v]
  float *W, *dW, *Xk, *Tl;   // [C, d_k] (Tl: the Kd term's share of dG_last)
  // [d_k, d_v] for the forward's output kernel; [d_v, d_k] (transposed) in the backward,
  // whose grads kernel reads them along d_k across its threads.
  float *S0, *dS;
  // For the tensor-core sequential kernels, written by prepare_tf32_kernel: Kd = exp(G_last -
  // G_r) k_r and Qg = exp(G_r) q_r [C, d_k] (zero past len), in Xk's and Tl's space (only
  // grads writes those, after the sequential kernels have read these), El = exp(G_last) [d_k].
  float *Kd, *Qg, *El;
  int64_t cc, cv, ck, kv;    // tile sizes
};

__host__ __device__ inline Tiles tiles_of(float* base, int64_t slot_heads, int64_t dk, int64_t dv) {
  Tiles t{};
  t.cc = int64_t{kC} * kC;
  t.cv = int64_t{kC} * dv;
  t.ck = int64_t{kC} * dk;
  t.kv = dk * dv;
  float* p = base;
  auto take = [&](int64_t size) {
    float* at = p;
    p += size * slot_heads;
    return at;
  };
  t.M = take(t.cc);
  t.A = take(t.cc);
  t.P = take(t.cc);
  t.U = take(t.cv);
  t.D = take(t.cv);
  t.dD = take(t.cv);
  t.Xv = take(t.cv);
  t.W = take(t.ck);
  t.dW = take(t.ck);
  t.Xk = take(t.ck);
  t.Tl = take(t.ck);
  t.S0 = take(t.kv);
  t.dS = take(t.kv);
  t.El = take(dk);
  t.Kd = t.Xk;
  t.Qg = t.Tl;
  return t;
}

int64_t tiles_elems(int64_t slot_heads, int64_t dk, int64_t dv) {
  const int64_t cc = int64_t{kC} * kC, cv = int64_t{kC} * dv, ck = int64_t{kC} * dk, kv = dk * dv;
  return slot_heads * (3 * cc + 4 * cv + 4 * ck + 2 * kv + dk);
}

// A chunk: its first token, length, document and slot.
struct Chunk {
  int64_t first, len, seq, slot;
};

__device__ __forceinline__ int64_t first_slot(const KdaArgs& s, int64_t seq) {
  return s.cu_seqlens[seq] / kC + seq;
}

// The chunk in `slot`, or false for an unused slot.
__device__ bool locate(const KdaArgs& s, int64_t slot, Chunk& c) {
  int64_t lo = 0, hi = s.num_seqs - 1;  // the last document whose first slot is <= slot
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (first_slot(s, mid) <= slot)
      lo = mid;
    else
      hi = mid - 1;
  }
  const int64_t begin = s.cu_seqlens[lo], end = s.cu_seqlens[lo + 1];
  const int64_t n = slot - first_slot(s, lo);
  if (n < 0) return false;
  c.first = begin + n * kC;
  if (c.first >= end) return false;
  c.len = end - c.first < kC ? end - c.first : kC;
  c.seq = lo;
  c.slot = slot;
  return true;
}

// The sum over a warp's lanes, every lane getting the same bits (a fixed xor butterfly).
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
  return x;
}

// The pair (r, col) of a chunk's [C, C] matrices that warp `u` of `warps` takes next: a warp
// per pair, its lanes along the rows' channels (coalesced reads, conflict-free shared ones).
struct WarpPairs {
  int lane = threadIdx.x & 31, first = threadIdx.x >> 5, step = blockDim.x >> 5;
};

// A chunk's rows of a [tokens, H, d] input for one head, `stride` elements apart: in global
// memory (rows_of), or staged in shared memory (stride d).
template <typename T>
struct Rows {
  const T* first;
  int64_t stride;
  __device__ float at(int64_t r, int64_t i) const { return to_f32(first[r * stride + i]); }
};

template <typename T>
__device__ Rows<T> rows_of(const T* x, const KdaArgs& s, const Chunk& c, int64_t h, int64_t d) {
  return {x + (c.first * s.heads + h) * d, s.heads * d};
}

// G (the cumulative log decay of rows 0..len-1) into cum [C, d_k] (rows ld apart): g's rows
// loaded by the whole block (coalesced), then a thread per channel adds them up in shared
// memory (a serial chain of global loads per channel was the sequential kernels' critical
// path). Every thread of the block must call it; a thread reads back only its own channels
// without a sync.
template <typename T>
__device__ void cumulative_decay(int64_t dk, Rows<T> g, int64_t len, float* cum, int64_t ld) {
  for (int64_t e = threadIdx.x; e < len * dk; e += blockDim.x) cum[e / dk * ld + e % dk] = g.at(e / dk, e % dk);
  __syncthreads();
  for (int64_t i = threadIdx.x; i < dk; i += blockDim.x) {
    float acc = 0.f;
    for (int64_t r = 0; r < len; ++r) {
      acc += cum[r * ld + i];
      cum[r * ld + i] = acc;
    }
  }
}

// ---- forward -------------------------------------------------------------------------------

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

constexpr int kSub = 16;              // sub-chunk rows
constexpr int kSubs = kC / kSub;      // 4
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
// the later kernels read whole tiles).
template <typename T>
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
    w.Qg[at * w.ck + e] = r < len ? expf(G) * q_rows.at(r, i) : 0.f;
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

// Kd [C, d_k] (rows ld apart) = exp(G_last - G_r) k_r (and, with qg, Qg [C, d_k] =
// exp(G_r) q_r), elast [d_k] = exp(G_last), from cum computed into kd first; then an element
// per thread. Every thread of the block calls it; it ends with a sync, elast written by each
// channel's own thread.
template <typename T>
__device__ void decayed_keys(int64_t dk, Rows<T> q, Rows<T> k, Rows<T> g, int64_t len, float* kd, int64_t ld,
                             float* qg, float* elast) {
  cumulative_decay(dk, g, len, kd, ld);
  for (int64_t i = threadIdx.x; i < dk; i += blockDim.x) elast[i] = kd[(len - 1) * ld + i];  // G_last, for now
  __syncthreads();
  for (int64_t e = threadIdx.x; e < len * dk; e += blockDim.x) {
    const int64_t r = e / dk, i = e % dk;
    float& kde = kd[r * ld + i];
    const float cr = kde;
    if (qg) qg[e] = expf(cr) * q.at(r, i);
    kde = expf(elast[i] - cr) * k.at(r, i);
  }
  __syncthreads();
  for (int64_t i = threadIdx.x; i < dk; i += blockDim.x) elast[i] = expf(elast[i]);
}

// The sequential kernels' products over a slice of Slice columns of the state: a thread
// keeps one column jj of it and takes the rows (or channels) group, group + kGroups, ..., so
// each value it loads along the other axis serves all of them from registers. Every output
// is still one thread's sum in the order of the loop it had alone, so the bits do not
// change with the slice. Narrower slices give more blocks (heads x documents x d_v / Slice)
// for the same work: at one sequence of K3's 6 heads, 24 blocks of 32 columns left most of
// the card idle.
template <int Slice>
struct SliceLane {
  static constexpr int kGroups = kThreads / Slice;
  static constexpr int kRows = kC / kGroups;                    // a chunk's rows per lane
  static constexpr int kChannels = kKdaChunkedMaxDk / kGroups;  // d_k's channels per lane
  static_assert(kThreads % Slice == 0 && kC % kGroups == 0 && kKdaChunkedMaxDk % kGroups == 0);

  int64_t jj = threadIdx.x % Slice, group = threadIdx.x / Slice;
  __device__ int64_t nth(int n) const { return group + int64_t{n} * kGroups; }

  // The lane's rows of a [C, Slice] result into the workspace's [C, d_v] tile (at column j =
  // j0 + jj, if j < d_v) and the shared [C, Slice] copy, rows past len as zero: the tensor
  // cores' products read whole tiles, and a stale row times a zero could be a NaN.
  __device__ void store_rows(const float (&rows)[kRows], int64_t len, int64_t j, int64_t dv, float* tile,
                             float* shared) const {
#pragma unroll
    for (int n = 0; n < kRows; ++n) {
      const int64_t r = nth(n);
      const float value = r < len ? rows[n] : 0.f;
      if (j < dv) tile[r * dv + j] = value;
      shared[r * Slice + jj] = value;
    }
  }
};

// A state's slice of Slice columns from j0 in shared memory, tile [d_k, Slice], against a
// state in global memory, [d_k, d_v] (or [d_v, d_k] with `transposed`). Columns past d_v
// load as zero and are not stored; a null state loads as zero.
template <int Slice>
__device__ void load_slice(const float* state, int64_t dk, int64_t dv, int64_t j0, float* tile) {
  for (int64_t e = threadIdx.x; e < dk * Slice; e += blockDim.x) {
    const int64_t i = e / Slice, j = j0 + e % Slice;
    tile[e] = state && j < dv ? state[i * dv + j] : 0.f;
  }
}

template <int Slice>
__device__ void store_slice(const float* tile, int64_t dk, int64_t dv, int64_t j0, float* state, bool transposed) {
  for (int64_t e = threadIdx.x; e < dk * Slice; e += blockDim.x) {
    const int64_t i = e / Slice, j = j0 + e % Slice;
    if (j < dv) state[transposed ? j * dk + i : i * dv + j] = tile[e];
  }
}

// The row stride in shared memory of the [C, d_k] tiles that lanes of one warp read at
// different rows and the same channel (W in states, Kd in state_grads): 4 floats of padding
// put those rows in different banks, and rows stay 16-byte aligned for the copies.
__host__ __device__ inline int64_t padded_ld(int64_t dk) { return dk % 4 == 0 ? dk + 4 : dk; }

// Starts copying `rows` rows of `cols` elements, src_ld apart in global memory, into shared
// memory rows dst_ld apart, without waiting for them (cp.async of 16 bytes where rows and
// addresses allow; element by element otherwise): the sequential kernels issue a chunk's
// tiles and inputs first, then store the state meanwhile. Read after finish_copies().
template <typename E>
__device__ void start_copy(E* dst, int64_t dst_ld, const E* src, int64_t src_ld, int64_t rows, int64_t cols) {
  constexpr int64_t kPer = 16 / sizeof(E);
  const bool vectors = cols % kPer == 0 && dst_ld % kPer == 0 && src_ld % kPer == 0 &&
                       reinterpret_cast<uintptr_t>(src) % 16 == 0 && reinterpret_cast<uintptr_t>(dst) % 16 == 0;
  if (vectors) {
    const int64_t per_row = cols / kPer;
    for (int64_t e = threadIdx.x; e < rows * per_row; e += blockDim.x) {
      const int64_t r = e / per_row, c = kPer * (e % per_row);
      __pipeline_memcpy_async(dst + r * dst_ld + c, src + r * src_ld + c, 16);
    }
  } else {
    for (int64_t e = threadIdx.x; e < rows * cols; e += blockDim.x) dst[e / cols * dst_ld + e % cols] = src[e / cols * src_ld + e % cols];
  }
  __pipeline_commit();
}

// Every thread's copies done but the `pending` last started, then a barrier: after it the
// whole block may read them.
template <int pending = 0>
__device__ void finish_copies() {
  __pipeline_wait_prior(pending);
  __syncthreads();
}

// One block per (d_v slice, head, document). Shared: the chunk's W [C, d_k] (rows padded_ld
// apart; copied in while its Kd is computed: read from global memory, its loads were the
// kernel's critical path), Kd [C, d_k], elast [d_k], S [d_k, Slice], D [C, Slice]; with
// Staged (where the card has the room) the chunk's g and k rows too, T [C, d_k] each, copied
// in while the state is stored: read from global memory element by element, a chunk's
// decayed keys waited on a chain of loads. S_0 is stored [d_k, d_v], or [d_v, d_k] with
// `transposed` (the backward's).
template <typename T, int Slice, bool Staged>
__global__ void __launch_bounds__(kThreads) states_kernel(KdaArgs s, Tiles w, const T* k, const T* g,
                                                          const float* h0, float* ht, bool transposed) {
  using Lane = SliceLane<Slice>;
  extern __shared__ float sm[];
  const int64_t h = blockIdx.y, seq = blockIdx.z, H = s.heads, dk = s.dk, dv = s.dv, j0 = blockIdx.x * Slice;
  const int64_t wld = padded_ld(dk);
  float* W = sm;
  float* kd = W + kC * wld;
  float* elast = kd + kC * dk;
  float* S = elast + dk;
  float* D = S + dk * Slice;
  T* gs = reinterpret_cast<T*>(D + kC * Slice);  // Staged only
  T* ks = gs + kC * dk;
  const int64_t begin = s.cu_seqlens[seq], end = s.cu_seqlens[seq + 1];
  const int64_t state = (seq * H + h) * dk * dv;
  load_slice<Slice>(h0 ? h0 + state : nullptr, dk, dv, j0, S);
  __syncthreads();
  for (int64_t first = begin, n = 0; first < end; first += kC, ++n) {
    const Chunk c{first, end - first < kC ? end - first : kC, seq, first_slot(s, seq) + n};
    const int64_t at = c.slot * H + h;
    Rows<T> g_rows = rows_of(g, s, c, h, dk), k_rows = rows_of(k, s, c, h, dk);
    if constexpr (Staged) {
      start_copy(gs, dk, g_rows.first, g_rows.stride, c.len, dk);
      start_copy(ks, dk, k_rows.first, k_rows.stride, c.len, dk);
      g_rows = {gs, dk}, k_rows = {ks, dk};
    }
    start_copy(W, wld, w.W + at * w.ck, dk, c.len, dk);
    store_slice<Slice>(S, dk, dv, j0, w.S0 + at * w.kv, transposed);
    if constexpr (Staged) finish_copies<1>();  // g and k; W may still be on its way
    decayed_keys<T>(dk, Rows<T>{}, k_rows, g_rows, c.len, kd, dk, nullptr, elast);
    finish_copies();
    const Lane lane;
    const int64_t j = j0 + lane.jj;
    // D = U - W S_0 (rows past len are computed from the last row and not kept).
    {
      float acc[Lane::kRows];
#pragma unroll
      for (int n = 0; n < Lane::kRows; ++n)
        acc[n] = j < dv ? w.U[at * w.cv + min(lane.nth(n), c.len - 1) * dv + j] : 0.f;
      if (j < dv)
        for (int64_t i = 0; i < dk; ++i) {
          const float si = S[i * Slice + lane.jj];
#pragma unroll
          for (int n = 0; n < Lane::kRows; ++n) acc[n] -= W[min(lane.nth(n), c.len - 1) * wld + i] * si;
        }
      lane.store_rows(acc, c.len, j, dv, w.D + at * w.cv, D);
    }
    __syncthreads();
    // S_L = Gamma_last S_0 + Kd^T D (channels past d_k likewise).
    {
      float acc[Lane::kChannels];
#pragma unroll
      for (int n = 0; n < Lane::kChannels; ++n) {
        const int64_t i = min(lane.nth(n), dk - 1);
        acc[n] = elast[i] * S[i * Slice + lane.jj];
      }
      for (int64_t r = 0; r < c.len; ++r) {
        const float d = D[r * Slice + lane.jj];
#pragma unroll
        for (int n = 0; n < Lane::kChannels; ++n) acc[n] += kd[r * dk + min(lane.nth(n), dk - 1)] * d;
      }
      __syncthreads();  // a clamped channel read S rows another thread now writes
#pragma unroll
      for (int n = 0; n < Lane::kChannels; ++n)
        if (lane.nth(n) < dk) S[lane.nth(n) * Slice + lane.jj] = acc[n];
    }
    __syncthreads();
  }
  if (ht) store_slice<Slice>(S, dk, dv, j0, ht + state, false);
}

// states_kernel on the tensor cores (Engine::tf32, slices of 16 or 32 columns): per chunk
// D = U - W S_0 and S_L = Gamma_last S_0 + Kd^T D by block_mma, from prepare_tf32_kernel's
// tiles (W, U, Kd, El: every row written, zero past len, so D's rows past len are zero and
// nothing stale is summed). The next chunk's tiles are copied by cp.async into the other of
// two buffers while this chunk is computed: a chunk no longer waits on its loads or forms its
// decayed keys in each slice's block. Shared: S [d_k, Slice], then two buffers of W and Kd
// [C, d_k] (rows d_k + 4 apart: fewer bank conflicts for wmma), U's slice [C, Slice] (D in
// place) and El [d_k].
template <int Slice>
__global__ void __launch_bounds__(kThreads) states_tf32_kernel(KdaArgs s, Tiles w, const float* h0, float* ht,
                                                               bool transposed) {
  using block_mma::product;
  extern __shared__ float sm[];
  const int64_t h = blockIdx.y, seq = blockIdx.z, H = s.heads, dk = s.dk, dv = s.dv, j0 = blockIdx.x * Slice;
  const int64_t ld = dk + 4, buffer = 2 * kC * ld + kC * Slice + dk;
  const int64_t cols = dv - j0 < Slice ? dv - j0 : Slice;  // U's columns in this slice
  float* S = sm;
  float* buffers = S + dk * Slice;
  const int64_t begin = s.cu_seqlens[seq], end = s.cu_seqlens[seq + 1], slot0 = first_slot(s, seq);
  const int64_t chunks = (end - begin + kC - 1) / kC, state = (seq * H + h) * dk * dv;
  if (cols < Slice)  // the columns past d_v stay zero in both buffers' U
    for (int64_t e = threadIdx.x; e < 2 * kC * Slice; e += blockDim.x)
      buffers[e / (kC * Slice) * buffer + 2 * kC * ld + e % (kC * Slice)] = 0.f;
  load_slice<Slice>(h0 ? h0 + state : nullptr, dk, dv, j0, S);
  // Four copies (four cp.async groups) per chunk.
  const auto fetch = [&](int64_t n) {
    float* b = buffers + n % 2 * buffer;
    const int64_t at = (slot0 + n) * H + h;
    start_copy(b, ld, w.W + at * w.ck, dk, kC, dk);
    start_copy(b + kC * ld, ld, w.Kd + at * w.ck, dk, kC, dk);
    start_copy(b + 2 * kC * ld, Slice, w.U + at * w.cv + j0, dv, kC, cols);
    start_copy(b + 2 * kC * ld + kC * Slice, dk, w.El + at * dk, dk, 1, dk);
  };
  if (chunks > 0) fetch(0);
  for (int64_t n = 0; n < chunks; ++n) {
    const int64_t at = (slot0 + n) * H + h;
    if (n + 1 < chunks) fetch(n + 1);  // into the buffer chunk n - 1 used, read before its last sync
    store_slice<Slice>(S, dk, dv, j0, w.S0 + at * w.kv, transposed);
    if (n + 1 < chunks)
      finish_copies<4>();  // chunk n's four; n + 1's may still be on their way
    else
      finish_copies();
    const float* W = buffers + n % 2 * buffer;
    const float* Kd = W + kC * ld;
    float* D = buffers + n % 2 * buffer + 2 * kC * ld;
    const float* El = D + kC * Slice;
    product<Engine::tf32, Layout::rows, Layout::rows>(kC, Slice, dk, -1.f, W, ld, S, Slice, 1.f, D, Slice);
    __syncthreads();
    for (int64_t e = threadIdx.x; e < kC * Slice; e += blockDim.x)
      if (e % Slice < cols) w.D[at * w.cv + e / Slice * dv + j0 + e % Slice] = D[e];
    for (int64_t e = threadIdx.x; e < dk * Slice; e += blockDim.x) S[e] *= El[e / Slice];
    __syncthreads();
    product<Engine::tf32, Layout::transposed, Layout::rows>(dk, Slice, kC, 1.f, Kd, ld, D, Slice, 1.f, S, Slice);
    __syncthreads();
  }
  if (ht) store_slice<Slice>(S, dk, dv, j0, ht + state, false);
}

// One block per (chunk, head). Shared: Qg [C, d_k]; with Staged (where the card has the
// room) the chunk's S_0 [d_k, d_v], P [C, C] and D [C, d_v] too, copied in while Qg is
// formed: each output element reads a column of S_0 and of D and a row of P.
template <typename T, bool Staged>
__global__ void __launch_bounds__(kThreads) output_kernel(KdaArgs s, Tiles w, const T* q, const T* g, T* out) {
  extern __shared__ float sm[];
  Chunk c;
  if (!locate(s, blockIdx.x, c)) return;
  const int64_t h = blockIdx.y, H = s.heads, dk = s.dk, dv = s.dv, at = c.slot * H + h;
  float* qg = sm;
  const float* S0 = w.S0 + at * w.kv;
  const float* P = w.P + at * w.cc;
  const float* D = w.D + at * w.cv;
  if constexpr (Staged) {
    float* S0_sh = qg + kC * dk;
    float* P_sh = S0_sh + dk * dv;
    float* D_sh = P_sh + kC * kC;
    start_copy(S0_sh, dv, S0, dv, dk, dv);
    start_copy(P_sh, kC, P, kC, c.len, kC);
    start_copy(D_sh, dv, D, dv, c.len, dv);
    S0 = S0_sh, P = P_sh, D = D_sh;
  }
  cumulative_decay(dk, rows_of(g, s, c, h, dk), c.len, qg, dk);
  for (int64_t i = threadIdx.x; i < dk; i += blockDim.x)
    for (int64_t r = 0; r < c.len; ++r)
      qg[r * dk + i] = expf(qg[r * dk + i]) * to_f32(q[((c.first + r) * H + h) * dk + i]);
  if constexpr (Staged) __pipeline_wait_prior(0);
  __syncthreads();
  for (int64_t e = threadIdx.x; e < c.len * dv; e += blockDim.x) {
    const int64_t r = e / dv, j = e % dv;
    float acc = 0.f;
    for (int64_t i = 0; i < dk; ++i) acc += qg[r * dk + i] * S0[i * dv + j];
    for (int64_t col = 0; col <= r; ++col) acc += P[r * kC + col] * D[col * dv + j];
    from_f32(s.scale * acc, out + ((c.first + r) * H + h) * dv + j);
  }
}

// output_kernel on the tensor cores: o = scale (Qg S_0 + P D), both products by block_mma
// from S_0, P and D in the workspace (P's columns and D's rows past len are zero there).
// Shared: Qg [C, d_k] and o [C, d_v], rows 4 floats longer than the tiles (fewer bank
// conflicts for wmma's loads).
template <typename T>
__global__ void __launch_bounds__(kThreads) output_tf32_kernel(KdaArgs s, Tiles w, const T* q, const T* g, T* out) {
  using block_mma::product;
  extern __shared__ float sm[];
  Chunk c;
  if (!locate(s, blockIdx.x, c)) return;
  const int64_t h = blockIdx.y, H = s.heads, dk = s.dk, dv = s.dv, at = c.slot * H + h;
  const int64_t qld = dk + 4, old = dv + 4;
  float* qg = sm;
  float* o = qg + kC * qld;
  cumulative_decay(dk, rows_of(g, s, c, h, dk), c.len, qg, qld);
  for (int64_t i = threadIdx.x; i < dk; i += blockDim.x)
    for (int64_t r = 0; r < c.len; ++r)
      qg[r * qld + i] = expf(qg[r * qld + i]) * to_f32(q[((c.first + r) * H + h) * dk + i]);
  product<Engine::tf32, Layout::rows, Layout::rows>(kC, dv, kC, 1.f, w.P + at * w.cc, kC, w.D + at * w.cv, dv, 0.f,
                                                    o, old);
  __syncthreads();  // Qg's rows; each warp also reads back the o tiles it stored
  product<Engine::tf32, Layout::rows, Layout::rows>(kC, dv, dk, 1.f, qg, qld, w.S0 + at * w.kv, dv, 1.f, o, old);
  __syncthreads();
  for (int64_t e = threadIdx.x; e < c.len * dv; e += blockDim.x) {
    const int64_t r = e / dv, j = e % dv;
    from_f32(s.scale * o[r * old + j], out + ((c.first + r) * H + h) * dv + j);
  }
}

// ---- backward ------------------------------------------------------------------------------

// One block per (d_v slice, head, document), chunks in reverse. Shared: the chunk's W [C,
// d_k], P [C, C] and dO slice [C, Slice] (copied in first, as in states_kernel), Kd [C, d_k]
// (rows padded_ld apart), Qg [C, d_k], elast [d_k], dS [d_k, Slice], dD [C, Slice]; with
// Staged the chunk's g, q and k rows, T [C, d_k] each, as in states_kernel.
template <typename T, int Slice, bool Staged>
__global__ void __launch_bounds__(kThreads) state_grads_kernel(KdaArgs s, Tiles w, const T* q, const T* k,
                                                               const T* g, const T* dout, const float* dht,
                                                               float* dh0) {
  using Lane = SliceLane<Slice>;
  extern __shared__ float sm[];
  const int64_t h = blockIdx.y, seq = blockIdx.z, H = s.heads, dk = s.dk, dv = s.dv, j0 = blockIdx.x * Slice;
  float* W = sm;
  float* P = W + kC * dk;
  float* dos = P + kC * kC;
  const int64_t kld = padded_ld(dk);
  float* kd = dos + kC * Slice;
  float* qg = kd + kC * kld;
  float* elast = qg + kC * dk;
  float* dS = elast + dk;
  float* dD = dS + dk * Slice;
  T* gs = reinterpret_cast<T*>(dD + kC * Slice);  // Staged only
  T* qs = gs + kC * dk;
  T* ks = qs + kC * dk;
  const int64_t begin = s.cu_seqlens[seq], end = s.cu_seqlens[seq + 1];
  const int64_t state = (seq * H + h) * dk * dv;
  load_slice<Slice>(dht ? dht + state : nullptr, dk, dv, j0, dS);
  __syncthreads();
  const int64_t chunks = (end - begin + kC - 1) / kC;
  for (int64_t n = chunks - 1; n >= 0; --n) {
    const int64_t first = begin + n * kC;
    const Chunk c{first, end - first < kC ? end - first : kC, seq, first_slot(s, seq) + n};
    const int64_t at = c.slot * H + h;
    Rows<T> g_rows = rows_of(g, s, c, h, dk), q_rows = rows_of(q, s, c, h, dk), k_rows = rows_of(k, s, c, h, dk);
    if constexpr (Staged) {
      start_copy(gs, dk, g_rows.first, g_rows.stride, c.len, dk);
      start_copy(qs, dk, q_rows.first, q_rows.stride, c.len, dk);
      start_copy(ks, dk, k_rows.first, k_rows.stride, c.len, dk);
      g_rows = {gs, dk}, q_rows = {qs, dk}, k_rows = {ks, dk};
    }
    start_copy(W, dk, w.W + at * w.ck, dk, c.len, dk);
    start_copy(P, kC, w.P + at * w.cc, kC, c.len, kC);
    for (int64_t e = threadIdx.x; e < c.len * Slice; e += blockDim.x) {
      const int64_t r = e / Slice, jj = e % Slice;
      dos[e] = j0 + jj < dv ? to_f32(dout[((c.first + r) * H + h) * dv + j0 + jj]) : 0.f;
    }
    store_slice<Slice>(dS, dk, dv, j0, w.dS + at * w.kv, /*transposed=*/true);
    if constexpr (Staged) finish_copies<2>();  // g, q and k; W and P may still be on their way
    decayed_keys<T>(dk, q_rows, k_rows, g_rows, c.len, kd, kld, qg, elast);
    finish_copies();
    const Lane lane;
    const int64_t j = j0 + lane.jj;
    auto dout_at = [&](int64_t r) { return dos[r * Slice + lane.jj]; };
    // dD = scale P^T dO + Kd dS, a lane's columns col = lane.nth(n) (past len: not kept).
    {
      float acc[Lane::kRows] = {};
      if (j < dv) {
        for (int64_t r = 0; r < c.len; ++r) {
          const float o = dout_at(r);
#pragma unroll
          for (int n = 0; n < Lane::kRows; ++n)
            if (lane.nth(n) <= r) acc[n] += P[r * kC + lane.nth(n)] * o;
        }
#pragma unroll
        for (int n = 0; n < Lane::kRows; ++n) acc[n] *= s.scale;
        for (int64_t i = 0; i < dk; ++i) {
          const float ds = dS[i * Slice + lane.jj];
#pragma unroll
          for (int n = 0; n < Lane::kRows; ++n) acc[n] += kd[min(lane.nth(n), c.len - 1) * kld + i] * ds;
        }
      }
      lane.store_rows(acc, c.len, j, dv, w.dD + at * w.cv, dD);
    }
    __syncthreads();
    // dS_0 = Gamma_last dS + scale Qg^T dO - W^T dD, a lane's channels i = lane.nth(n).
    if (j < dv) {
      float through_q[Lane::kChannels] = {}, through_w[Lane::kChannels] = {};
      for (int64_t r = 0; r < c.len; ++r) {
        const float o = dout_at(r), d = dD[r * Slice + lane.jj];
#pragma unroll
        for (int n = 0; n < Lane::kChannels; ++n) {
          const int64_t i = min(lane.nth(n), dk - 1);
          through_q[n] += qg[r * dk + i] * o;
          through_w[n] += W[r * dk + i] * d;
        }
      }
#pragma unroll
      for (int n = 0; n < Lane::kChannels; ++n) {
        const int64_t i = lane.nth(n);
        if (i < dk) dS[i * Slice + lane.jj] = elast[i] * dS[i * Slice + lane.jj] + s.scale * through_q[n] - through_w[n];
      }
    }
    __syncthreads();
  }
  if (dh0) store_slice<Slice>(dS, dk, dv, j0, dh0 + state, false);
}

// state_grads_kernel on the tensor cores (Engine::tf32, slices of 16 or 32 columns): per
// chunk, in reverse, dD = scale P^T dO + Kd dS and dS_0 = Gamma_last dS + scale Qg^T dO - W^T
// dD by block_mma, from prepare_tf32_kernel's tiles (W, P, Kd, Qg, El; every row written,
// zero past len) instead of forming the decayed keys and queries in each slice's block.
// Shared: dS [d_k, Slice], dD and dO [C, Slice] (fp32; dO zero past len), W, Kd and Qg
// [C, d_k] (rows d_k + 4 apart), P [C, C], El [d_k], and dO's rows as T [C, Slice]. One
// buffer: two would not fit beside these at d_k = 128.
template <typename T, int Slice>
__global__ void __launch_bounds__(kThreads) state_grads_tf32_kernel(KdaArgs s, Tiles w, const T* dout,
                                                                    const float* dht, float* dh0) {
  using block_mma::product;
  extern __shared__ float sm[];
  const int64_t h = blockIdx.y, seq = blockIdx.z, H = s.heads, dk = s.dk, dv = s.dv, j0 = blockIdx.x * Slice;
  const int64_t ld = dk + 4, cols = dv - j0 < Slice ? dv - j0 : Slice;
  float* dS = sm;
  float* dD = dS + dk * Slice;
  float* dos = dD + kC * Slice;
  float* W = dos + kC * Slice;
  float* Kd = W + kC * ld;
  float* Qg = Kd + kC * ld;
  float* P = Qg + kC * ld;
  float* El = P + kC * kC;
  T* dout_rows = reinterpret_cast<T*>(El + dk);
  const int64_t begin = s.cu_seqlens[seq], end = s.cu_seqlens[seq + 1];
  const int64_t state = (seq * H + h) * dk * dv;
  load_slice<Slice>(dht ? dht + state : nullptr, dk, dv, j0, dS);
  for (int64_t n = (end - begin + kC - 1) / kC - 1; n >= 0; --n) {
    const int64_t first = begin + n * kC, len = end - first < kC ? end - first : kC;
    const int64_t at = (first_slot(s, seq) + n) * H + h;
    start_copy(W, ld, w.W + at * w.ck, dk, kC, dk);
    start_copy(Kd, ld, w.Kd + at * w.ck, dk, kC, dk);
    start_copy(Qg, ld, w.Qg + at * w.ck, dk, kC, dk);
    start_copy(P, kC, w.P + at * w.cc, kC, kC, kC);
    start_copy(El, dk, w.El + at * dk, dk, 1, dk);
    start_copy(dout_rows, Slice, dout + (first * H + h) * dv + j0, H * dv, len, cols);
    store_slice<Slice>(dS, dk, dv, j0, w.dS + at * w.kv, /*transposed=*/true);
    finish_copies();
    for (int64_t e = threadIdx.x; e < kC * Slice; e += blockDim.x)
      dos[e] = e / Slice < len && e % Slice < cols ? to_f32(dout_rows[e]) : 0.f;
    __syncthreads();
    product<Engine::tf32, Layout::transposed, Layout::rows>(kC, Slice, kC, s.scale, P, kC, dos, Slice, 0.f, dD, Slice);
    __syncthreads();  // each warp reads back the dD tiles it stored
    product<Engine::tf32, Layout::rows, Layout::rows>(kC, Slice, dk, 1.f, Kd, ld, dS, Slice, 1.f, dD, Slice);
    __syncthreads();
    for (int64_t e = threadIdx.x; e < kC * Slice; e += blockDim.x)
      if (e % Slice < cols) w.dD[at * w.cv + e / Slice * dv + j0 + e % Slice] = dD[e];
    for (int64_t e = threadIdx.x; e < dk * Slice; e += blockDim.x) dS[e] *= El[e / Slice];
    __syncthreads();
    product<Engine::tf32, Layout::transposed, Layout::rows>(dk, Slice, kC, s.scale, Qg, ld, dos, Slice, 1.f, dS, Slice);
    __syncthreads();
    product<Engine::tf32, Layout::transposed, Layout::rows>(dk, Slice, kC, -1.f, W, ld, dD, Slice, 1.f, dS, Slice);
    __syncthreads();
  }
  if (dh0) store_slice<Slice>(dS, dk, dv, j0, dh0 + state, false);
}

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

// grads' last steps, the same in both kernels. dbeta_r = db_r + sum_{s<r} dL_rs A_rs (dL in
// pm, A the workspace's tile), a thread per row.
template <typename T>
__device__ void store_dbeta(const Chunk& c, int64_t h, int64_t H, const float* pm, const float* A, const float* db,
                            T* dbeta) {
  for (int64_t r = threadIdx.x; r < c.len; r += blockDim.x) {
    float acc = db[r];
    for (int64_t col = 0; col < r; ++col) acc += pm[r * kC + col] * A[r * kC + col];
    from_f32(acc, dbeta + (c.first + r) * H + h);
  }
}

// dg = the reversed cumulative sum of dG (gc), a thread per channel; dq, dk out.
template <typename T>
__device__ void store_dg_dq_dk(const Chunk& c, int64_t h, int64_t H, int64_t dk, const float* gq, const float* gk,
                               const float* gc, T* dg, T* dq_out, T* dk_out) {
  const auto krow = [&](int64_t r) { return ((c.first + r) * H + h) * dk; };
  for (int64_t i = threadIdx.x; i < dk; i += blockDim.x) {
    float acc = 0.f;
    for (int64_t r = c.len - 1; r >= 0; --r) {
      acc += gc[r * dk + i];
      from_f32(acc, dg + krow(r) + i);
    }
  }
  for (int64_t e = threadIdx.x; e < c.len * dk; e += blockDim.x) {
    const int64_t r = e / dk, i = e % dk;
    from_f32(gq[e], dq_out + krow(r) + i);
    from_f32(gk[e], dk_out + krow(r) + i);
  }
}

// How much of its inputs grads_kernel copies into shared memory: what the card has room for.
enum class GradsStaging {
  none,     // 148 KiB at d_k = d_v = 128 (below), inside an A100's 163 KiB
  inputs,   // + the chunk's k and q rows, T [C, d_k] each
  outputs,  // + its dO rows, T [C, d_v], and D, f32 [C, d_v]: 224.5 KiB in bf16 at 128, inside
            //   Hopper's 227 KiB
};

// One block per (chunk, head). Shared: cum, gq, gk, gc (dG) [C, d_k], a pair matrix [C, C]
// (dP, then dL), beta [C] and dbeta [C], and what `staging` adds: the pairwise loops read
// every k and q row len times, the dP pairs and the S_0 / dS products every dO and D row as
// often, from shared memory then rather than through the caches (those loads' latency was
// the kernel's time: it is all fp32 SIMT arithmetic).
template <typename T, GradsStaging staging>
__global__ void __launch_bounds__(kGradsThreads) grads_kernel(KdaArgs s, Tiles w, const T* q, const T* k, const T* v,
                                                         const T* g, const T* beta, const T* dout, T* dq_out,
                                                         T* dk_out, T* dv_out, T* dg, T* dbeta) {
  extern __shared__ float sm[];
  Chunk c;
  if (!locate(s, blockIdx.x, c)) return;
  const int64_t h = blockIdx.y, H = s.heads, dk = s.dk, dv = s.dv, len = c.len, last = len - 1;
  const int64_t at = c.slot * H + h;
  const float scale = s.scale;
  float* cum = sm;
  float* gq = cum + kC * dk;
  float* gk = gq + kC * dk;
  float* gc = gk + kC * dk;
  float* pm = gc + kC * dk;
  float* bt = pm + kC * kC;
  float* db = bt + kC;
  constexpr bool inputs = staging != GradsStaging::none, outputs = staging == GradsStaging::outputs;
  T* ks = reinterpret_cast<T*>(db + kC);  // inputs and outputs only
  T* qs = ks + kC * dk;
  T* dos = qs + kC * dk;  // outputs only
  float* Ds = reinterpret_cast<float*>(dos + kC * dv);
  auto krow = [&](int64_t r) { return ((c.first + r) * H + h) * dk; };
  auto vrow = [&](int64_t r) { return ((c.first + r) * H + h) * dv; };
  const float* D = w.D + at * w.cv;
  if constexpr (inputs) {
    start_copy(ks, dk, k + krow(0), H * dk, len, dk);
    start_copy(qs, dk, q + krow(0), H * dk, len, dk);
  }
  if constexpr (outputs) {
    start_copy(dos, dv, dout + vrow(0), H * dv, len, dv);
    start_copy(Ds, dv, D, dv, len, dv);
  }
  auto key = [&](int64_t r, int64_t i) {
    if constexpr (inputs)
      return to_f32(ks[r * dk + i]);
    else
      return to_f32(k[krow(r) + i]);
  };
  const auto query = [&](int64_t r, int64_t i) {
    if constexpr (inputs)
      return to_f32(qs[r * dk + i]);
    else
      return to_f32(q[krow(r) + i]);
  };
  const auto out_grad = [&](int64_t r, int64_t j) {
    if constexpr (outputs)
      return to_f32(dos[r * dv + j]);
    else
      return to_f32(dout[vrow(r) + j]);
  };
  const auto delta = [&](int64_t r, int64_t j) {
    if constexpr (outputs)
      return Ds[r * dv + j];
    else
      return D[r * dv + j];
  };
  const float* S0 = w.S0 + at * w.kv;  // both [d_v, d_k]
  const float* dS = w.dS + at * w.kv;
  const float* dD = w.dD + at * w.cv;
  const float* M = w.M + at * w.cc;
  float* dW = w.dW + at * w.ck;
  float* Xk = w.Xk + at * w.ck;
  float* Xv = w.Xv + at * w.cv;
  float* Tl = w.Tl + at * w.ck;

  cumulative_decay(dk, rows_of(g, s, c, h, dk), len, cum, dk);
  for (int64_t e = threadIdx.x; e < kC * dk; e += blockDim.x) gq[e] = gk[e] = gc[e] = 0.f;
  for (int64_t r = threadIdx.x; r < kC; r += blockDim.x) bt[r] = r < len ? to_f32(beta[(c.first + r) * H + h]) : 0.f;
  if constexpr (inputs) finish_copies();
  // dP_rs = scale dO_r . D_s (s <= r), a warp per pair.
  const WarpPairs pairs;
  for (int64_t e = pairs.first; e < kC * kC; e += pairs.step) {
    const int64_t r = e / kC, col = e % kC;
    float acc = 0.f;
    if (r < len && col <= r) {
      for (int64_t j = pairs.lane; j < dv; j += 32) acc += out_grad(r, j) * delta(col, j);
      acc = warp_sum(acc);
    }
    if (pairs.lane == 0) pm[e] = scale * acc;
  }
  __syncthreads();
  // P's pairwise terms (with the diagonal), a thread per channel.
  const auto unit = [](int64_t) { return 1.f; };
  pairwise_gradient(len, dk, cum, pm, true, query, key, unit, gq, gk, gc);
  __syncthreads();
  // Per element (r, i): Qg's gradient through S_0, Kd's through dS, and dW = -dD S_0^T. A
  // thread keeps channel i and takes kRows rows at a time, so each S_0 and dS value it
  // loads serves kRows rows (read once per row, they were the kernel's largest traffic).
  {
    constexpr int kRows = 4;
    const int64_t groups = blockDim.x / dk, i = threadIdx.x % dk, group = threadIdx.x / dk;
    for (int64_t r0 = group * kRows; group < groups && r0 < len; r0 += groups * kRows) {
      float sdo[kRows] = {}, sdd[kRows] = {}, skd[kRows] = {};
      int64_t rows[kRows];
#pragma unroll
      for (int n = 0; n < kRows; ++n) rows[n] = r0 + n < len ? r0 + n : len - 1;  // past len: computed, not kept
      for (int64_t j = 0; j < dv; ++j) {
        const float s0 = S0[j * dk + i], ds = dS[j * dk + i];
#pragma unroll
        for (int n = 0; n < kRows; ++n) {
          sdo[n] += s0 * out_grad(rows[n], j);
          sdd[n] += s0 * dD[rows[n] * dv + j];
          skd[n] += ds * delta(rows[n], j);
        }
      }
#pragma unroll
      for (int n = 0; n < kRows; ++n) {
        const int64_t r = r0 + n, e = r * dk + i;
        if (r >= len) break;
        const float er = expf(cum[e]), qi = query(r, i);
        gq[e] += scale * er * sdo[n];
        gc[e] += scale * qi * er * sdo[n];
        dW[e] = -sdd[n];
        const float el = expf(cum[last * dk + i] - cum[e]);
        gk[e] += el * skd[n];
        const float t = r == last ? 0.f : key(r, i) * el * skd[n];
        Tl[e] = t;
        gc[e] -= t;
      }
    }
  }
  __syncthreads();
  // dG_last: the Kd terms' shares and S_0's decay.
  for (int64_t i = threadIdx.x; i < dk; i += blockDim.x) {
    float acc = 0.f, decay = 0.f;
    for (int64_t r = 0; r < last; ++r) acc += Tl[r * dk + i];
    for (int64_t j = 0; j < dv; ++j) decay += S0[j * dk + i] * dS[j * dk + i];
    gc[last * dk + i] += acc + expf(cum[last * dk + i]) * decay;
  }
  __syncthreads();
  // X_v = M^T dD (and dv = beta X_v), X_k = M^T dW with its terms of dk and dG.
  for (int64_t e = threadIdx.x; e < len * dv; e += blockDim.x) {
    const int64_t col = e / dv, j = e % dv;
    float acc = 0.f;
    for (int64_t r = col; r < len; ++r) acc += M[r * kC + col] * dD[r * dv + j];
    Xv[e] = acc;
    from_f32(bt[col] * acc, dv_out + vrow(col) + j);
  }
  for (int64_t e = threadIdx.x; e < len * dk; e += blockDim.x) {
    const int64_t col = e / dk, i = e % dk;
    float acc = 0.f;
    for (int64_t r = col; r < len; ++r) acc += M[r * kC + col] * dW[r * dk + i];
    Xk[e] = acc;
    const float ec = expf(cum[e]);
    gk[e] += bt[col] * ec * acc;
    gc[e] += bt[col] * key(col, i) * ec * acc;
  }
  __syncthreads();
  // dbeta_c = v_c . X_v[c] + Kg_c . X_k[c]; dL_rs = -(X_v[r] . U[s] + X_k[r] . W[s]) (s < r).
  const float* U = w.U + at * w.cv;
  const float* W = w.W + at * w.ck;
  for (int64_t col = threadIdx.x; col < len; col += blockDim.x) {
    float acc = 0.f;
    for (int64_t j = 0; j < dv; ++j) acc += to_f32(v[vrow(col) + j]) * Xv[col * dv + j];
    for (int64_t i = 0; i < dk; ++i) acc += key(col, i) * expf(cum[col * dk + i]) * Xk[col * dk + i];
    db[col] = acc;
  }
  for (int64_t e = pairs.first; e < kC * kC; e += pairs.step) {
    const int64_t r = e / kC, col = e % kC;
    float acc = 0.f;
    if (r < len && col < r) {
      for (int64_t j = pairs.lane; j < dv; j += 32) acc += Xv[r * dv + j] * U[col * dv + j];
      for (int64_t i = pairs.lane; i < dk; i += 32) acc += Xk[r * dk + i] * W[col * dk + i];
      acc = warp_sum(acc);
    }
    if (pairs.lane == 0) pm[e] = -acc;
  }
  __syncthreads();
  // dbeta_r += sum_{s<r} dL_rs A_rs; A's pairwise terms with dA_rs = beta_r dL_rs.
  store_dbeta(c, h, H, pm, w.A + at * w.cc, db, dbeta);
  const auto beta_of = [&](int64_t r) { return bt[r]; };
  pairwise_gradient(len, dk, cum, pm, false, key, key, beta_of, gk, gk, gc);
  __syncthreads();
  store_dg_dq_dk(c, h, H, dk, gq, gk, gc, dg, dq_out, dk_out);
}

// grads_kernel with its plain matrix products on the tensor cores (block_mma, Engine::tf32;
// bf16 inputs with d_k, d_v multiples of 16): dP = scale dO D^T, Qg's gradient through S_0
// (dO S_0), Kd's through dS (D dS), dW = -dD S_0 (into the workspace), X_v = M^T dD, X_k =
// M^T dW and dL = -(X_v U^T + X_k W^T); with PairwiseTc the two pairwise gradients' sums off
// the 16 x 16 diagonal blocks too (pairwise_gradient_tf32). The elementwise terms around
// them, dbeta's row dots and the diagonal blocks' pairwise terms (all of them without
// PairwiseTc) as in grads_kernel.
// Shared: cum, gq, gk [C, d_k]; gc [C, d_k], whose room holds dO first, fp32 [C, d_v + 4]
// (zero past len: wmma takes fp32, and it is only the products' operand); a pair matrix
// [C, C] (dP, then dL), beta [C], dbeta [C]; with PairwiseTc the pairwise sums' staging
// (kPairStage floats, 40.5 KiB); with StagedInputs the chunk's k and q rows, T [C, d_k] each,
// as in grads_kernel. The other operands are read by wmma from the workspace:
// D, dD (zero past len), M (zero past len) and S_0, dS whole; X_v, X_k and dW are written
// for all C rows (zero past len, so X_k's sum over dW's rows reads no stale value). U's and
// W's stale rows past len reach only dL's columns past len, which are zeroed.
template <typename T, bool StagedInputs, bool PairwiseTc>
__global__ void __launch_bounds__(kGradsThreads)
    grads_tf32_kernel(KdaArgs s, Tiles w, const T* q, const T* k, const T* v, const T* g, const T* beta,
                      const T* dout, T* dq_out, T* dk_out, T* dv_out, T* dg, T* dbeta) {
  using block_mma::product;
  constexpr Engine E = Engine::tf32;
  extern __shared__ float sm[];
  Chunk c;
  if (!locate(s, blockIdx.x, c)) return;
  const int64_t h = blockIdx.y, H = s.heads, dk = s.dk, dv = s.dv, len = c.len, last = len - 1;
  const int64_t at = c.slot * H + h, dold = dv + 4;
  const float scale = s.scale;
  float* cum = sm;
  float* gq = cum + kC * dk;
  float* gk = gq + kC * dk;
  float* gc = gk + kC * dk;
  float* dos = gc;  // until the products are done
  float* pm = gc + kC * (dk > dold ? dk : dold);
  float* bt = pm + kC * kC;
  float* db = bt + kC;
  float* stage = db + kC;  // PairwiseTc only
  T* ks = reinterpret_cast<T*>(stage + (PairwiseTc ? kPairStage : 0));  // StagedInputs only
  T* qs = ks + kC * dk;
  auto krow = [&](int64_t r) { return ((c.first + r) * H + h) * dk; };
  auto vrow = [&](int64_t r) { return ((c.first + r) * H + h) * dv; };
  if constexpr (StagedInputs) {
    start_copy(ks, dk, k + krow(0), H * dk, len, dk);
    start_copy(qs, dk, q + krow(0), H * dk, len, dk);
  }
  const auto key = [&](int64_t r, int64_t i) {
    if constexpr (StagedInputs)
      return to_f32(ks[r * dk + i]);
    else
      return to_f32(k[krow(r) + i]);
  };
  const auto query = [&](int64_t r, int64_t i) {
    if constexpr (StagedInputs)
      return to_f32(qs[r * dk + i]);
    else
      return to_f32(q[krow(r) + i]);
  };
  const float* S0 = w.S0 + at * w.kv;  // both [d_v, d_k]
  const float* dS = w.dS + at * w.kv;
  const float* D = w.D + at * w.cv;
  const float* dD = w.dD + at * w.cv;
  const float* M = w.M + at * w.cc;
  float* dW = w.dW + at * w.ck;
  float* Xk = w.Xk + at * w.ck;
  float* Xv = w.Xv + at * w.cv;
  float* Tl = w.Tl + at * w.ck;

  cumulative_decay(dk, rows_of(g, s, c, h, dk), len, cum, dk);
  for (int64_t r = threadIdx.x; r < kC; r += blockDim.x) bt[r] = r < len ? to_f32(beta[(c.first + r) * H + h]) : 0.f;
  for (int64_t e = threadIdx.x; e < kC * dv; e += blockDim.x) {
    const int64_t r = e / dv, j = e % dv;
    dos[r * dold + j] = r < len ? to_f32(dout[vrow(r) + j]) : 0.f;
  }
  __syncthreads();
  // The products of the workspace's tiles and dO (independent: no barrier between them).
  // gq and gk take dO S_0 and D dS raw; the epilogue below scales them in place.
  product<E, Layout::rows, Layout::transposed>(kC, kC, dv, scale, dos, dold, D, dv, 0.f, pm, kC);
  product<E, Layout::rows, Layout::rows>(kC, dk, dv, 1.f, dos, dold, S0, dk, 0.f, gq, dk);
  product<E, Layout::rows, Layout::rows>(kC, dk, dv, 1.f, D, dv, dS, dk, 0.f, gk, dk);
  product<E, Layout::rows, Layout::rows>(kC, dk, dv, -1.f, dD, dv, S0, dk, 0.f, dW, dk);
  product<E, Layout::transposed, Layout::rows>(kC, dv, kC, 1.f, M, kC, dD, dv, 0.f, Xv, dv);
  if constexpr (StagedInputs) __pipeline_wait_prior(0);
  __syncthreads();  // dO's room is gc's from here
  product<E, Layout::transposed, Layout::rows>(kC, dk, kC, 1.f, M, kC, dW, dk, 0.f, Xk, dk);
  // Per element (r, i): Qg's gradient through S_0 (sdo), Kd's through dS (skd); gc starts
  // here. The same thread per element as pairwise_gradient's and the X_k loop's below.
  for (int64_t e = threadIdx.x; e < len * dk; e += blockDim.x) {
    const int64_t r = e / dk, i = e % dk;
    const float sdo = gq[e], skd = gk[e];
    const float er = expf(cum[e]), el = expf(cum[last * dk + i] - cum[e]);
    gq[e] = scale * er * sdo;
    gk[e] = el * skd;
    const float t = r == last ? 0.f : key(r, i) * el * skd;
    Tl[e] = t;
    gc[e] = scale * query(r, i) * er * sdo - t;
  }
  for (int64_t e = threadIdx.x; e < len * dv; e += blockDim.x)
    from_f32(bt[e / dv] * Xv[e], dv_out + vrow(e / dv) + e % dv);
  __syncthreads();
  // P's pairwise terms (with the diagonal), then X_k's terms of dk and dG: each thread its
  // own elements in both loops (pairwise_gradient's), or after pairwise_gradient_tf32's
  // closing barrier.
  const auto unit = [](int64_t) { return 1.f; };
  if constexpr (PairwiseTc)
    pairwise_gradient_tf32(len, dk, cum, pm, true, query, key, unit, gq, gk, gc, stage);
  else
    pairwise_gradient(len, dk, cum, pm, true, query, key, unit, gq, gk, gc);
  for (int64_t e = threadIdx.x; e < len * dk; e += blockDim.x) {
    const int64_t col = e / dk, i = e % dk;
    const float ec = expf(cum[e]), x = Xk[e];
    gk[e] += bt[col] * ec * x;
    gc[e] += bt[col] * key(col, i) * ec * x;
  }
  __syncthreads();
  // dG_last: the Kd terms' shares and S_0's decay.
  for (int64_t i = threadIdx.x; i < dk; i += blockDim.x) {
    float acc = 0.f, decay = 0.f;
    for (int64_t r = 0; r < last; ++r) acc += Tl[r * dk + i];
    for (int64_t j = 0; j < dv; ++j) decay += S0[j * dk + i] * dS[j * dk + i];
    gc[last * dk + i] += acc + expf(cum[last * dk + i]) * decay;
  }
  // dbeta_c = v_c . X_v[c] + Kg_c . X_k[c]; dL = -(X_v U^T + X_k W^T), kept for s < r.
  for (int64_t col = threadIdx.x; col < len; col += blockDim.x) {
    float acc = 0.f;
    for (int64_t j = 0; j < dv; ++j) acc += to_f32(v[vrow(col) + j]) * Xv[col * dv + j];
    for (int64_t i = 0; i < dk; ++i) acc += key(col, i) * expf(cum[col * dk + i]) * Xk[col * dk + i];
    db[col] = acc;
  }
  product<E, Layout::rows, Layout::transposed>(kC, kC, dv, -1.f, Xv, dv, w.U + at * w.cv, dv, 0.f, pm, kC);
  __syncthreads();  // each warp reads back the dL tiles it stored
  product<E, Layout::rows, Layout::transposed>(kC, kC, dk, -1.f, Xk, dk, w.W + at * w.ck, dk, 1.f, pm, kC);
  __syncthreads();
  for (int64_t e = threadIdx.x; e < kC * kC; e += blockDim.x)
    if (e / kC >= len || e % kC >= e / kC) pm[e] = 0.f;  // U's and W's stale rows land past len
  __syncthreads();
  // dbeta_r += sum_{s<r} dL_rs A_rs; A's pairwise terms with dA_rs = beta_r dL_rs.
  store_dbeta(c, h, H, pm, w.A + at * w.cc, db, dbeta);
  const auto beta_of = [&](int64_t r) { return bt[r]; };
  if constexpr (PairwiseTc)
    pairwise_gradient_tf32(len, dk, cum, pm, false, key, key, beta_of, gk, gk, gc, stage);  // ends synced
  else
    pairwise_gradient(len, dk, cum, pm, false, key, key, beta_of, gk, gk, gc);
  __syncthreads();
  store_dg_dq_dk(c, h, H, dk, gq, gk, gc, dg, dq_out, dk_out);
}

// ---- launches ------------------------------------------------------------------------------

size_t floats(int64_t n) { return static_cast<size_t>(n) * sizeof(float); }

template <typename Kernel>
void allow_shared(Kernel kernel, size_t bytes, const char* op) {
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)), op,
        "cudaFuncSetAttribute");
}

// The most shared memory a block of this device may opt in to.
size_t shared_limit(const char* op) {
  int device = 0, limit = 0;
  check(cudaGetDevice(&device), op, "cudaGetDevice");
  check(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device), op, "shared memory limit");
  return static_cast<size_t>(limit);
}

// The chunk kernels' grid: a block per (chunk slot, head).
dim3 chunks_grid(const KdaArgs& a) {
  return dim3(static_cast<unsigned>(slots_of(a.tokens, a.num_seqs)), static_cast<unsigned>(a.heads));
}

// The sequential kernels' slice width: the caller's (KdaArgs::slice), else the widest of 32
// and 16 columns whose blocks (d_v / Slice x heads x documents) number at least twice the
// card's SMs, else 8 (16 on the tensor cores, whose tiles are 16 wide). Narrower slices recompute each chunk's decayed keys in more blocks, so
// they pay only where blocks are few (K3's 6 heads of 128 on an H100, forward + backward:
// one sequence 10.3 / 8.1 / 6.9 ms at 32 / 16 / 8 columns, eight 40.7 / 38.8 / 43.4).
int sequential_slice(const KdaArgs& a, Engine engine, const char* op) {
  if (a.slice != 0) return a.slice;
  int device = 0, sms = 0;
  check(cudaGetDevice(&device), op, "cudaGetDevice");
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), op, "SM count");
  for (const int slice : {32, 16})
    if ((a.dv + slice - 1) / slice * a.heads * a.num_seqs >= 2 * int64_t{sms}) return slice;
  return engine == Engine::tf32 ? 16 : 8;  // the tensor cores' narrowest
}

template <int Slice>
dim3 documents_grid(const KdaArgs& a) {
  return dim3(static_cast<unsigned>((a.dv + Slice - 1) / Slice), static_cast<unsigned>(a.heads),
              static_cast<unsigned>(a.num_seqs));
}

// f.template operator()<Slice>() for the slice width chosen at run time.
template <typename F>
void by_slice(int slice, F&& f) {
  if (slice == 32)
    f.template operator()<32>();
  else if (slice == 16)
    f.template operator()<16>();
  else
    f.template operator()<8>();
}

// The sequential kernels on the tensor cores where they apply: the engine is (bf16 inputs
// with d_k, d_v multiples of 16), the slice is 16 or 32 columns (wmma's tiles are 16 wide;
// the callers test it at compile time) and `bytes` of shared memory fit the card. They read
// prepare_tf32_kernel's tiles, which runs wherever the engine is the tensor cores.
template <typename T>
bool sequential_on_tensor_cores(const KdaArgs& a, size_t bytes, const char* op) {
  return engine_of<T>(a) == Engine::tf32 && bytes <= shared_limit(op);
}

// prepare, then states: the factors, S_0 of every chunk and D; ht if given.
template <typename T>
void factors_and_states(const ExecContext& ctx, const KdaArgs& a, const Tiles& w, const T* q, const T* k, const T* v,
                        const T* g, const T* beta, const float* h0, float* ht, bool transposed, int slice,
                        const char* op) {
  [&] {
    if constexpr (std::is_same_v<T, bf16>)
      if (engine_of<T>(a) == Engine::tf32) {
        const size_t bytes = floats(kC * (a.dk + 4) + 2 * kC * kC + kC);
        allow_shared(prepare_tf32_kernel<T>, bytes, op);
        prepare_tf32_kernel<T><<<chunks_grid(a), kThreads, bytes, stream(ctx)>>>(a, w, q, k, v, g, beta);
        return;
      }
    const size_t bytes = floats(kC * a.dk + 2 * kC * kC + kC);
    allow_shared(prepare_kernel<T>, bytes, op);
    prepare_kernel<T><<<chunks_grid(a), kThreads, bytes, stream(ctx)>>>(a, w, q, k, v, g, beta);
  }();
  check_launch(op, "prepare_kernel");
  by_slice(slice, [&]<int Slice>() {
    const dim3 grid = documents_grid<Slice>(a);
    const size_t tc = floats(a.dk * Slice + 2 * (2 * kC * (a.dk + 4) + kC * Slice + a.dk));
    if constexpr (Slice >= 16)
      if (sequential_on_tensor_cores<T>(a, tc, op)) {
        allow_shared(states_tf32_kernel<Slice>, tc, op);
        states_tf32_kernel<Slice><<<grid, kThreads, tc, stream(ctx)>>>(a, w, h0, ht, transposed);
        check_launch(op, "states_tf32_kernel");
        return;
      }
    const size_t st = floats(kC * padded_ld(a.dk) + kC * a.dk + a.dk + a.dk * Slice + kC * Slice);
    const size_t staged = st + 2 * kC * a.dk * sizeof(T);
    const auto launch = [&]<bool Staged>(size_t bytes) {
      allow_shared(states_kernel<T, Slice, Staged>, bytes, op);
      states_kernel<T, Slice, Staged><<<grid, kThreads, bytes, stream(ctx)>>>(a, w, k, g, h0, ht, transposed);
    };
    if (staged <= shared_limit(op))
      launch.template operator()<true>(staged);
    else
      launch.template operator()<false>(st);
    check_launch(op, "states_kernel");
  });
}

template <typename T>
void forward_launch(const ExecContext& ctx, const KdaArgs& a, const T* q, const T* k, const T* v, const T* g,
                    const T* beta, const float* h0, T* out, float* ht, float* workspace) {
  const char* op = "kda_chunked_forward";
  const Tiles w = tiles_of(workspace, slots_of(a.tokens, a.num_seqs) * a.heads, a.dk, a.dv);
  factors_and_states<T>(ctx, a, w, q, k, v, g, beta, h0, ht, /*transposed=*/false, sequential_slice(a, engine_of<T>(a), op), op);
  if (a.tokens == 0) return;
  if constexpr (std::is_same_v<T, bf16>)
    if (engine_of<T>(a) == Engine::tf32) {
      const size_t bytes = floats(kC * (a.dk + 4) + kC * (a.dv + 4));
      allow_shared(output_tf32_kernel<T>, bytes, op);
      output_tf32_kernel<T><<<chunks_grid(a), kThreads, bytes, stream(ctx)>>>(a, w, q, g, out);
      check_launch(op, "output_tf32_kernel");
      return;
    }
  const size_t smem = floats(kC * a.dk), staged = smem + floats(a.dk * a.dv + kC * kC + kC * a.dv);
  if (staged <= shared_limit(op)) {
    allow_shared(output_kernel<T, true>, staged, op);
    output_kernel<T, true><<<chunks_grid(a), kThreads, staged, stream(ctx)>>>(a, w, q, g, out);
  } else {
    allow_shared(output_kernel<T, false>, smem, op);
    output_kernel<T, false><<<chunks_grid(a), kThreads, smem, stream(ctx)>>>(a, w, q, g, out);
  }
  check_launch(op, "output_kernel");
}

// grads_tf32_kernel where the engine is the tensor cores and its shared memory fits: with the
// pairwise sums on the tensor cores where their staging fits, and the chunk's k and q rows
// where they fit too (at d_k = d_v = 128: 145.5 + 40.5 + 32 = 218 KiB, inside Hopper's 227);
// false otherwise, for grads_kernel.
template <typename T>
bool backward_grads_tf32(const ExecContext& ctx, const KdaArgs& a, const Tiles& w, const T* q, const T* k,
                         const T* v, const T* g, const T* beta, const T* dout, T* dq, T* dk, T* dv, T* dg, T* dbeta,
                         const char* op) {
  if constexpr (std::is_same_v<T, bf16>) {
    if (engine_of<T>(a) != Engine::tf32) return false;
    const int64_t gc_room = kC * (a.dk > a.dv + 4 ? a.dk : a.dv + 4);  // gc, or dO in fp32 before it
    const size_t none = floats(3 * kC * a.dk + gc_room + kC * kC + 2 * kC);
    const size_t pairwise = none + floats(kPairStage), inputs = pairwise + 2 * kC * a.dk * sizeof(T);
    const size_t limit = shared_limit(op);
    const auto launch = [&]<bool StagedInputs, bool PairwiseTc>(size_t bytes) {
      allow_shared(grads_tf32_kernel<T, StagedInputs, PairwiseTc>, bytes, op);
      grads_tf32_kernel<T, StagedInputs, PairwiseTc><<<chunks_grid(a), kGradsThreads, bytes, stream(ctx)>>>(
          a, w, q, k, v, g, beta, dout, dq, dk, dv, dg, dbeta);
    };
    if (inputs <= limit)
      launch.template operator()<true, true>(inputs);
    else if (pairwise <= limit)
      launch.template operator()<false, true>(pairwise);
    else if (none <= limit)
      launch.template operator()<false, false>(none);
    else
      return false;
    check_launch(op, "grads_tf32_kernel");
    return true;
  }
  return false;
}

template <typename T>
void backward_launch(const ExecContext& ctx, const KdaArgs& a, const T* q, const T* k, const T* v, const T* g,
                     const T* beta, const float* h0, const T* dout, const float* dht, T* dq, T* dk, T* dv, T* dg,
                     T* dbeta, float* dh0, float* workspace) {
  const char* op = "kda_chunked_backward";
  const Tiles w = tiles_of(workspace, slots_of(a.tokens, a.num_seqs) * a.heads, a.dk, a.dv);
  const int slice = sequential_slice(a, engine_of<T>(a), op);
  factors_and_states<T>(ctx, a, w, q, k, v, g, beta, h0, nullptr, /*transposed=*/true, slice, op);
  by_slice(slice, [&]<int Slice>() {
    const dim3 grid = documents_grid<Slice>(a);
    const size_t tc =
        floats(a.dk * Slice + 2 * kC * Slice + 3 * kC * (a.dk + 4) + kC * kC + a.dk) + kC * Slice * sizeof(T);
    if constexpr (Slice >= 16 && std::is_same_v<T, bf16>)
      if (sequential_on_tensor_cores<T>(a, tc, op)) {
        allow_shared(state_grads_tf32_kernel<T, Slice>, tc, op);
        state_grads_tf32_kernel<T, Slice><<<grid, kThreads, tc, stream(ctx)>>>(a, w, dout, dht, dh0);
        check_launch(op, "state_grads_tf32_kernel");
        return;
      }
    const size_t sg = floats(2 * kC * a.dk + kC * padded_ld(a.dk) + kC * kC + kC * Slice + a.dk + a.dk * Slice +
                             kC * Slice);
    const size_t staged = sg + 3 * kC * a.dk * sizeof(T);
    const auto launch = [&]<bool Staged>(size_t bytes) {
      allow_shared(state_grads_kernel<T, Slice, Staged>, bytes, op);
      state_grads_kernel<T, Slice, Staged><<<grid, kThreads, bytes, stream(ctx)>>>(a, w, q, k, g, dout, dht, dh0);
    };
    if (staged <= shared_limit(op))
      launch.template operator()<true>(staged);
    else
      launch.template operator()<false>(sg);
    check_launch(op, "state_grads_kernel");
  });
  if (a.tokens == 0) return;
  if (backward_grads_tf32<T>(ctx, a, w, q, k, v, g, beta, dout, dq, dk, dv, dg, dbeta, op)) return;
  const size_t none = floats(4 * kC * a.dk + kC * kC + 2 * kC), inputs = none + 2 * kC * a.dk * sizeof(T),
               outputs = inputs + kC * a.dv * (sizeof(T) + sizeof(float)), limit = shared_limit(op);
  const auto launch = [&]<GradsStaging staging>(size_t bytes) {
    allow_shared(grads_kernel<T, staging>, bytes, op);
    grads_kernel<T, staging><<<chunks_grid(a), kGradsThreads, bytes, stream(ctx)>>>(a, w, q, k, v, g, beta, dout, dq,
                                                                                   dk, dv, dg, dbeta);
  };
  if (outputs <= limit)
    launch.template operator()<GradsStaging::outputs>(outputs);
  else if (inputs <= limit)
    launch.template operator()<GradsStaging::inputs>(inputs);
  else
    launch.template operator()<GradsStaging::none>(none);
  check_launch(op, "grads_kernel");
}

template <typename F>
void by_dtype(DType dtype, F&& f) {
  if (dtype == DType::f32)
    f.template operator()<float>();
  else
    f.template operator()<bf16>();
}

}  // namespace

int64_t kda_chunked_workspace_elems(int64_t tokens, int64_t heads, int64_t dk, int64_t dv, int64_t num_seqs) {
  return tiles_elems(slots_of(tokens, num_seqs) * heads, dk, dv);
}

void kda_chunked_forward(const ExecContext& ctx, const KdaArgs& a, const void* q, const void* k, const void* v,
                         const void* g, const void* beta, const float* h0, void* out, float* ht, float* workspace) {
  if (a.num_seqs == 0 || a.heads == 0 || a.dv == 0) return;
  KILN_CHECK(a.dk >= 1 && a.dk <= kKdaChunkedMaxDk, "kda_chunked_forward", "d_k must be 1..{} on the GPU, got {}",
             kKdaChunkedMaxDk, a.dk);
  by_dtype(a.dtype, [&]<typename T>() {
    forward_launch<T>(ctx, a, static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v),
                      static_cast<const T*>(g), static_cast<const T*>(beta), h0, static_cast<T*>(out), ht, workspace);
  });
}

void kda_chunked_backward(const ExecContext& ctx, const KdaArgs& a, const void* q, const void* k, const void* v,
                          const void* g, const void* beta, const float* h0, const void* dout, const float* dht,
                          void* dq, void* dk, void* dv, void* dg, void* dbeta, float* dh0, float* workspace) {
  if (a.num_seqs == 0 || a.heads == 0 || a.dv == 0) return;
  KILN_CHECK(a.dk >= 1 && a.dk <= kKdaChunkedMaxDk, "kda_chunked_backward", "d_k must be 1..{} on the GPU, got {}",
             kKdaChunkedMaxDk, a.dk);
  by_dtype(a.dtype, [&]<typename T>() {
    backward_launch<T>(ctx, a, static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v),
                       static_cast<const T*>(g), static_cast<const T*>(beta), h0, static_cast<const T*>(dout), dht,
                       static_cast<T*>(dq), static_cast<T*>(dk), static_cast<T*>(dv), static_cast<T*>(dg),
                       static_cast<T*>(dbeta), dh0, workspace);
  });
}

}  // namespace kiln::cuda

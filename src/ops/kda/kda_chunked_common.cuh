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
//           On the tensor cores, prepare_tf32_kernel also writes each chunk's decayed keys
//           Kd, queries Qg (the backward's prepare only) and exp(G_last) (Tiles::Kd, Qg, El),
//           which states_tf32_kernel and state_grads_tf32_kernel read instead of forming them
//           in every slice's block;
//           states_tf32_kernel copies the next chunk's tiles while it computes this one.
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
//
// This header holds what the kernels' files share, in kiln::cuda::kda_chunked: the tiles,
// chunk lookup, device helpers and launch helpers. The kernels: kda_chunked_prepare.cu
// (prepare), kda_chunked_states.cu (states, and factors_and_states: prepare then states),
// kda_chunked_forward.cu (output, the forward), kda_chunked_state_grads.cu (state_grads),
// kda_chunked_backward.cu (grads, with kda_chunked_pairwise.cuh's pairwise gradients, and
// the backward).
#pragma once

#include "ops/kda/kda_chunked_cuda.h"

#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "core/error.h"
#include "ops/bf16_vector.cuh"
#include "ops/block_mma.cuh"

#include <cuda_bf16.h>
#include <cuda_pipeline.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <type_traits>
#include <utility>

namespace kiln::cuda::kda_chunked {

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

inline int64_t slots_of(int64_t tokens, int64_t num_seqs) { return tokens / kC + num_seqs; }

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
  // G_r) k_r and Qg = exp(G_r) q_r [C, d_k] (zero past len; Qg in the backward only), in Xk's
  // and Tl's space (only grads writes those, after the sequential kernels have read these),
  // El = exp(G_last) [d_k].
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

// The grads kernels' tiles of one (slot, head) (at = slot H + h): they read S_0 and dS ([d_v,
// d_k]), D, dD and M, and write dW, X_k, X_v and Tl.
struct GradTiles {
  const float *S0, *dS, *D, *dD, *M;
  float *dW, *Xk, *Xv, *Tl;
};

__device__ inline GradTiles grad_tiles(const Tiles& w, int64_t at) {
  return {w.S0 + at * w.kv, w.dS + at * w.kv, w.D + at * w.cv, w.dD + at * w.cv, w.M + at * w.cc,
          w.dW + at * w.ck, w.Xk + at * w.ck, w.Xv + at * w.cv, w.Tl + at * w.ck};
}

inline int64_t tiles_elems(int64_t slot_heads, int64_t dk, int64_t dv) {
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
__device__ inline bool locate(const KdaArgs& s, int64_t slot, Chunk& c) {
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
// memory (rows_of), or staged in shared memory (stride d). A call reads as at(), for the
// pairwise gradients' row functions.
template <typename T>
struct Rows {
  const T* first;
  int64_t stride;
  __device__ float at(int64_t r, int64_t i) const { return to_f32(first[r * stride + i]); }
  __device__ float operator()(int64_t r, int64_t i) const { return at(r, i); }
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

// prepare_tf32_kernel's sub-chunks, which the pairwise gradients on the tensor cores share.
constexpr int kSub = 16;              // sub-chunk rows
constexpr int kSubs = kC / kSub;      // 4

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

// ---- launches ------------------------------------------------------------------------------

inline size_t floats(int64_t n) { return static_cast<size_t>(n) * sizeof(float); }

// The current device and what the launches size themselves by, asked of the runtime once per
// device: the launches run on every step (inside graph capture too), and these attribute
// queries were most of their host work.
struct DeviceLimits {
  int device;
  size_t shared;  // the most shared memory a block may opt in to
  int sms;
};

inline DeviceLimits device_limits(const char* op) {
  constexpr int kDevices = 64;
  static DeviceLimits known[kDevices];
  static std::once_flag asked[kDevices];
  int device = 0;
  check(cudaGetDevice(&device), op, "cudaGetDevice");
  KILN_CHECK(device >= 0 && device < kDevices, op, "device {} is past the {} devices KDA keeps limits for", device,
             kDevices);
  std::call_once(asked[device], [&] {
    int shared = 0, sms = 0;
    check(cudaDeviceGetAttribute(&shared, cudaDevAttrMaxSharedMemoryPerBlockOptin, device), op, "shared memory limit");
    check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), op, "SM count");
    known[device] = {device, static_cast<size_t>(shared), sms};
  });
  return known[device];
}

// Lets `kernel` take `bytes` of dynamic shared memory on the current device. The attribute
// only rises: the runtime is called when bytes exceed what this kernel was allowed on this
// device before, so once per (kernel, device) at a fixed shape, not on every launch.
template <typename Kernel>
void allow_shared(Kernel kernel, size_t bytes, const char* op) {
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, size_t> allowed;
  const int device = device_limits(op).device;
  const std::lock_guard<std::mutex> lock(mutex);
  size_t& most = allowed[{reinterpret_cast<const void*>(kernel), device}];
  if (bytes <= most) return;
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)), op,
        "cudaFuncSetAttribute");
  most = bytes;
}

// The most shared memory a block of this device may opt in to.
inline size_t shared_limit(const char* op) { return device_limits(op).shared; }

// The chunk kernels' grid: a block per (chunk slot, head).
inline dim3 chunks_grid(const KdaArgs& a) {
  return dim3(static_cast<unsigned>(slots_of(a.tokens, a.num_seqs)), static_cast<unsigned>(a.heads));
}

// The sequential kernels' slice width: the caller's (KdaArgs::slice), else the widest of 32
// and 16 columns whose blocks (d_v / Slice x heads x documents) number at least twice the
// card's SMs, else 8 (16 on the tensor cores, whose tiles are 16 wide). Narrower slices recompute each chunk's decayed keys in more blocks, so
// they pay only where blocks are few (K3's 6 heads of 128 on an H100, forward + backward:
// one sequence 10.3 / 8.1 / 6.9 ms at 32 / 16 / 8 columns, eight 40.7 / 38.8 / 43.4).
inline int sequential_slice(const KdaArgs& a, Engine engine, const char* op) {
  if (a.slice != 0) return a.slice;
  const int sms = device_limits(op).sms;
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


template <typename F>
void by_dtype(DType dtype, F&& f) {
  if (dtype == DType::f32)
    f.template operator()<float>();
  else
    f.template operator()<bf16>();
}

// ---- launches across files (defined, for float and bf16, in the file named) ----------------

// prepare_kernel, or prepare_tf32_kernel where the engine is the tensor cores: the factors of
// every chunk (kda_chunked_prepare.cu). With query_tiles (the backward's) the tensor cores'
// prepare also writes Qg, which only state_grads_tf32_kernel reads; the forward skips it.
template <typename T>
void prepare_launch(const ExecContext& ctx, const KdaArgs& a, const Tiles& w, const T* q, const T* k, const T* v,
                    const T* g, const T* beta, bool query_tiles, const char* op);

// prepare, then states: the factors, S_0 of every chunk and D; ht if given
// (kda_chunked_states.cu).
template <typename T>
void factors_and_states(const ExecContext& ctx, const KdaArgs& a, const Tiles& w, const T* q, const T* k, const T* v,
                        const T* g, const T* beta, const float* h0, float* ht, bool transposed, bool query_tiles,
                        int slice, const char* op);

// state_grads_kernel, or state_grads_tf32_kernel on the tensor cores: dS of every chunk and
// dD; dh0 if given (kda_chunked_state_grads.cu).
template <typename T>
void state_grads_launch(const ExecContext& ctx, const KdaArgs& a, const Tiles& w, const T* q, const T* k, const T* g,
                        const T* dout, const float* dht, float* dh0, int slice, const char* op);

// values_bf16_kernel, grads_bf16_kernel and dbeta_bf16_kernel where the engine is the
// tensor cores and the slab's shared memory fits: dq, dk, dv, dg, dbeta; false otherwise
// (kda_chunked_grads_bf16.cu).
template <typename T>
bool backward_grads_bf16(const ExecContext& ctx, const KdaArgs& a, const Tiles& w, const T* q, const T* k,
                         const T* v, const T* g, const T* beta, const T* dout, T* dq, T* dk, T* dv, T* dg, T* dbeta,
                         const char* op);

}  // namespace kiln::cuda::kda_chunked

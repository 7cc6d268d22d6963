// The MoE dispatch, gather and combine kernels and the experts' weighted SwiGLU backward
// (declared in moe_cuda.h).
//
// Dispatch, a counting sort that keeps the CPU's order: the pairs are cut into chunks of
// consecutive pairs, one per block.
//   1. count_chunks: each block's per-expert counts of its chunk (integer adds in shared
//      memory: the counts do not depend on their order) into chunk_counts [chunks, E];
//   2. scan_chunks (one block): per expert, the chunks' counts turn into the rows before
//      each chunk (an exclusive scan over chunks, in chunk order), their sum into counts,
//      and offsets = the exclusive scan of counts;
//   3. place_pairs: a pair's row = offsets[e] + rows of e before its chunk + pairs of e
//      before it in its chunk.
// Rows of an expert are therefore in pair order, as the CPU's stable counting sort gives,
// for any schedule. chunk_counts is the context's device scratch (core/context_scratch.h):
// each stream has its own and runs its dispatches one after another, so two dispatches
// never share it at once.
//
// Row kernels (gather, gather backward, combine, combine backward): a warp per row, eight
// rows per 256-thread block; rows whose width is a multiple of 8 with 16-byte aligned
// data move 8 elements per access, others one.
#include "ops/moe/moe_cuda.h"

#include "core/context_scratch.h"
#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "core/error.h"
#include "ops/bf16_vector.cuh"
#include "ops/block_reduce.cuh"

#include <cuda_bf16.h>

#include <algorithm>
#include <initializer_list>

namespace kiln::cuda {

namespace {

using bf16 = __nv_bfloat16;
using vec::load;
using vec::store;

constexpr int kThreads = 256;
constexpr int kRowsPerBlock = kThreads / kWarpSize;
constexpr int kVec = vec::kWidth;

// ---- dispatch -----------------------------------------------------------------------------

constexpr int64_t kChunkCountsMax = int64_t{1} << 22;  // 16 MiB of per-chunk expert counts
constexpr int64_t kMostChunks = 128;
constexpr ScratchKind kChunkCounts{"moe_dispatch", kChunkCountsMax * sizeof(int32_t)};

// An expert id, or -1 for an empty slot.
__device__ __forceinline__ int32_t checked_expert(const int32_t* experts, int64_t p, int64_t e_count) {
  const int32_t e = experts[p];
  if (e < -1 || e >= e_count) __trap();  // the front end cannot read ids; a router never writes these
  return e;
}

// Block b counts chunk b's pairs [b chunk, (b + 1) chunk) per expert.
__global__ void count_chunks(const int32_t* __restrict__ experts, int64_t pairs, int64_t e_count, int64_t chunk,
                             int32_t* __restrict__ chunk_counts) {
  extern __shared__ int32_t hist[];
  for (int64_t e = threadIdx.x; e < e_count; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  const int64_t begin = blockIdx.x * chunk, end = min(begin + chunk, pairs);
  for (int64_t p = begin + threadIdx.x; p < end; p += blockDim.x) {
    const int32_t e = checked_expert(experts, p, e_count);
    if (e >= 0) atomicAdd(&hist[e], 1);
  }
  __syncthreads();
  for (int64_t e = threadIdx.x; e < e_count; e += blockDim.x) chunk_counts[blockIdx.x * e_count + e] = hist[e];
}

constexpr int kScanThreads = 1024;

// The rows expert e keeps of its routed pairs.
__device__ __forceinline__ int32_t kept_rows(int32_t routed, int64_t capacity) {
  return capacity > 0 && routed > capacity ? static_cast<int32_t>(capacity) : routed;
}

// One block: chunk_counts[b][e] becomes the pairs of e in chunks before b; counts from their
// sums, offsets from the rows kept (a Hillis-Steele scan of 1024 experts at a time), and
// *dropped += the pairs past the capacity (integer adds: any order gives the same sum).
__global__ void __launch_bounds__(kScanThreads)
    scan_chunks(int64_t chunks, int64_t e_count, int64_t capacity, int64_t rows, int32_t* __restrict__ chunk_counts,
                int32_t* __restrict__ counts, int32_t* __restrict__ offsets, int32_t* __restrict__ dropped) {
  __shared__ int32_t dropped_here;
  if (threadIdx.x == 0) dropped_here = 0;
  __syncthreads();
  for (int64_t e = threadIdx.x; e < e_count; e += blockDim.x) {
    int32_t running = 0;
    for (int64_t b = 0; b < chunks; ++b) {
      const int32_t c = chunk_counts[b * e_count + e];
      chunk_counts[b * e_count + e] = running;
      running += c;
    }
    counts[e] = running;
    if (running > kept_rows(running, capacity)) atomicAdd(&dropped_here, running - kept_rows(running, capacity));
  }
  __syncthreads();
  if (threadIdx.x == 0 && dropped) *dropped += dropped_here;
  __shared__ int32_t scan[kScanThreads];
  int32_t carry = 0;
  if (threadIdx.x == 0) offsets[0] = 0;
  for (int64_t base = 0; base < e_count; base += kScanThreads) {
    const int64_t e = base + threadIdx.x;
    scan[threadIdx.x] = e < e_count ? kept_rows(counts[e], capacity) : 0;
    __syncthreads();
    for (int offset = 1; offset < kScanThreads; offset *= 2) {
      const int32_t add = threadIdx.x >= offset ? scan[threadIdx.x - offset] : 0;
      __syncthreads();
      scan[threadIdx.x] += add;
      __syncthreads();
    }
    if (e < e_count) offsets[e + 1] = carry + scan[threadIdx.x];  // inclusive: the row after expert e's
    carry += scan[kScanThreads - 1];
    __syncthreads();
  }
  if (threadIdx.x == 0 && carry > rows) __trap();  // the router promised at most `rows` pairs
}

// Block b places chunk b's pairs: its experts staged in shared memory, each pair counts
// the pairs of its expert before it in the chunk; an empty pair, or one past its expert's
// kept rows, gets row -1.
__global__ void place_pairs(const int32_t* __restrict__ experts, int64_t pairs, int64_t e_count, int64_t chunk,
                            const int32_t* __restrict__ chunk_counts, const int32_t* __restrict__ offsets,
                            int32_t* __restrict__ pair_of_row, int32_t* __restrict__ row_of_pair) {
  extern __shared__ int32_t ids[];
  const int64_t begin = blockIdx.x * chunk, n = min(chunk, pairs - begin);
  for (int64_t q = threadIdx.x; q < n; q += blockDim.x) ids[q] = experts[begin + q];
  __syncthreads();
  for (int64_t q = threadIdx.x; q < n; q += blockDim.x) {
    const int32_t e = ids[q];
    if (e < 0) {
      row_of_pair[begin + q] = -1;
      continue;
    }
    int32_t before = 0;
    for (int64_t i = 0; i < q; ++i) before += ids[i] == e;
    const int32_t rank = chunk_counts[blockIdx.x * e_count + e] + before;  // among the expert's pairs
    if (rank >= offsets[e + 1] - offsets[e]) {
      row_of_pair[begin + q] = -1;  // past the capacity: dropped
      continue;
    }
    const int32_t row = offsets[e] + rank;
    pair_of_row[row] = static_cast<int32_t>(begin + q);
    row_of_pair[begin + q] = row;
  }
}

// ---- rows ---------------------------------------------------------------------------------

bool vectorizable(int64_t cols, std::initializer_list<const void*> pointers) {
  if (cols % kVec != 0) return false;
  for (const void* p : pointers)
    if (!vec::aligned16(p)) return false;
  return true;
}

// grouped row r = x row pair_of_row[r] / k for the live rows, zero past them.
template <typename T, int W>
__global__ void __launch_bounds__(kThreads)
    gather_kernel(const T* __restrict__ x, int64_t rows, int64_t cols, int64_t k, const int32_t* __restrict__ pair_of_row,
                  const int32_t* __restrict__ live, T* __restrict__ grouped) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarpSize;
  if (r >= rows) return;
  T* dst = grouped + r * cols;
  if (r >= *live) {
    float zero[W];
#pragma unroll
    for (int i = 0; i < W; ++i) zero[i] = 0.0f;
    for (int64_t c = lane * W; c < cols; c += kWarpSize * W) store<W>(dst + c, zero);
    return;
  }
  const T* src = x + (pair_of_row[r] / k) * cols;
  for (int64_t c = lane * W; c < cols; c += kWarpSize * W) {
    float v[W];
    load<W>(src + c, v);
    store<W>(dst + c, v);
  }
}

// dx row t (= or +=) the sum of dgrouped rows row_of_pair[t k + j], j = 0..k-1 in order.
template <typename T, int W>
__global__ void __launch_bounds__(kThreads)
    gather_backward_kernel(const T* __restrict__ dgrouped, int64_t tokens, int64_t cols, int64_t k,
                           const int32_t* __restrict__ row_of_pair, T* __restrict__ dx, bool accumulate) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarpSize;
  if (t >= tokens) return;
  T* out = dx + t * cols;
  for (int64_t c = lane * W; c < cols; c += kWarpSize * W) {
    float acc[W];
    if (accumulate) {
      load<W>(out + c, acc);
    } else {
#pragma unroll
      for (int i = 0; i < W; ++i) acc[i] = 0.0f;
    }
    for (int64_t j = 0; j < k; ++j) {
      const int32_t row = row_of_pair[t * k + j];
      if (row < 0) continue;
      float v[W];
      load<W>(dgrouped + static_cast<int64_t>(row) * cols + c, v);
#pragma unroll
      for (int i = 0; i < W; ++i) acc[i] += v[i];
    }
    store<W>(out + c, acc);
  }
}

// out row t = sum_j weights[t, j] y row row_of_pair[t k + j], j in order.
template <typename T, int W>
__global__ void __launch_bounds__(kThreads)
    combine_kernel(const T* __restrict__ y, const float* __restrict__ weights, int64_t tokens, int64_t cols,
                   int64_t k, const int32_t* __restrict__ row_of_pair, T* __restrict__ out) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarpSize;
  if (t >= tokens) return;
  for (int64_t c = lane * W; c < cols; c += kWarpSize * W) {
    float acc[W];
#pragma unroll
    for (int i = 0; i < W; ++i) acc[i] = 0.0f;
    for (int64_t j = 0; j < k; ++j) {
      const int32_t row = row_of_pair[t * k + j];
      if (row < 0) continue;
      const float w = weights[t * k + j];
      float v[W];
      load<W>(y + static_cast<int64_t>(row) * cols + c, v);
#pragma unroll
      for (int i = 0; i < W; ++i) acc[i] += w * v[i];
    }
    store<W>(out + t * cols + c, acc);
  }
}

// Pair p = t k + j: dy row (row_of_pair[p]) = weights[p] dout row t; dweights[p] = dout row
// t . y row: each lane sums its columns in order, then the warp's butterfly.
template <typename T, int W>
__global__ void __launch_bounds__(kThreads)
    combine_backward_kernel(const T* __restrict__ y, const float* __restrict__ weights, const T* __restrict__ dout,
                            int64_t pairs, int64_t cols, int64_t k, const int32_t* __restrict__ row_of_pair,
                            T* __restrict__ dy, float* __restrict__ dweights) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t p = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarpSize;
  if (p >= pairs) return;  // whole warps leave together: the butterfly below has all lanes
  const int64_t row = row_of_pair[p];
  if (row < 0) {  // empty or dropped: no row, no gradient
    if (lane == 0) dweights[p] = 0.0f;
    return;
  }
  const T* g = dout + (p / k) * cols;
  const float w = weights[p];
  float dot = 0.0f;
  for (int64_t c = lane * W; c < cols; c += kWarpSize * W) {
    float gv[W], yv[W], out[W];
    load<W>(g + c, gv);
    load<W>(y + row * cols + c, yv);
#pragma unroll
    for (int i = 0; i < W; ++i) {
      out[i] = w * gv[i];
      dot += gv[i] * yv[i];
    }
    store<W>(dy + row * cols + c, out);
  }
  dot = warp_sum(dot);
  if (lane == 0) dweights[p] = dot;
}

// Row r of the grouped layout (a warp): SwiGLU's backward from w_p du_r, w_p act_r for the
// down projection's weight gradient, and dweights[p] = du_r . act_r (each lane's columns in
// order, then the warp's butterfly). Rows past the live ones are written zero, du unread.
// The element formulas are swiglu_cuda.cu's. weighted_act may alias du: each element is
// read before it is written, by the same lane.
template <typename T, int W>
__global__ void __launch_bounds__(kThreads)
    swiglu_backward_kernel(const T* __restrict__ gu, const T* du, const float* __restrict__ weights, int64_t rows,
                           int64_t f, const int32_t* __restrict__ pair_of_row, const int32_t* __restrict__ live,
                           T* __restrict__ dgu, T* weighted_act, float* __restrict__ dweights) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarpSize;
  if (r >= rows) return;  // whole warps leave together: the butterfly below has all lanes
  const bool is_live = r < *live;
  const int32_t p = is_live ? pair_of_row[r] : -1;
  const float w = is_live ? weights[p] : 0.0f;
  float dot = 0.0f;
  for (int64_t c = lane * W; c < f; c += kWarpSize * W) {
    float g[W], u[W], d[W], dg[W], dup[W], a[W];
    if (is_live) {
      load<W>(gu + r * 2 * f + c, g);
      load<W>(gu + r * 2 * f + f + c, u);
      load<W>(du + r * f + c, d);
    } else {
#pragma unroll
      for (int i = 0; i < W; ++i) g[i] = u[i] = d[i] = 0.0f;
    }
#pragma unroll
    for (int i = 0; i < W; ++i) {
      const float s = 1.0f / (1.0f + expf(-g[i]));
      const float act = g[i] / (1.0f + expf(-g[i])) * u[i];
      const float dy = w * d[i];
      dot += d[i] * act;
      dg[i] = dy * u[i] * s * (1.0f + g[i] * (1.0f - s));
      dup[i] = dy * g[i] * s;
      a[i] = w * act;
    }
    store<W>(dgu + r * 2 * f + c, dg);
    store<W>(dgu + r * 2 * f + f + c, dup);
    store<W>(weighted_act + r * f + c, a);
  }
  dot = warp_sum(dot);
  if (is_live && lane == 0) dweights[p] = dot;
}

unsigned row_blocks(int64_t rows) { return static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock); }

// Runs launch.template operator()<T, W>() for the dtype's element type and the widest access.
template <typename Launch>
void by_dtype(DType dtype, bool vector, Launch&& launch) {
  if (dtype == DType::bf16) {
    vector ? launch.template operator()<bf16, kVec>() : launch.template operator()<bf16, 1>();
  } else if (dtype == DType::f32) {
    vector ? launch.template operator()<float, kVec>() : launch.template operator()<float, 1>();
  } else {
    fail("moe", "no CUDA kernel for {} rows", dtype_name(dtype));
  }
}

}  // namespace

void moe_dispatch(const ExecContext& ctx, const int32_t* experts, int64_t pairs, int64_t e_count, int64_t capacity, int64_t rows,
                  int32_t* counts, int32_t* offsets, int32_t* pair_of_row, int32_t* row_of_pair, int32_t* dropped) {
  constexpr const char* kOp = "moe_dispatch";
  // Chunks of at least kThreads pairs, longer so that there are at most kMostChunks of them:
  // scan_chunks walks the chunks of an expert one after another (a 4096 x 8 micro-batch has
  // 262144 pairs: 128 chunks of 2048, not 1024 of 256), and place_pairs' count of earlier
  // pairs in a chunk reads shared memory at one address per step for the whole warp.
  KILN_CHECK(e_count <= kChunkCountsMax / kMostChunks, kOp, "{} experts", e_count);
  const int64_t wanted = (pairs + kMostChunks - 1) / kMostChunks;
  const int64_t chunk = std::max<int64_t>(kThreads, (wanted + kThreads - 1) / kThreads * kThreads);
  const int64_t chunks = (pairs + chunk - 1) / chunk;
  const size_t hist_bytes = static_cast<size_t>(e_count) * sizeof(int32_t);
  const size_t ids_bytes = static_cast<size_t>(chunk) * sizeof(int32_t);
  KILN_CHECK(hist_bytes <= 48u << 10 && ids_bytes <= 48u << 10, kOp, "{} experts over {} pairs need {} and {} bytes of "
             "shared memory", e_count, pairs, hist_bytes, ids_bytes);
  int32_t* scratch = context_scratch_as<int32_t>(ctx, kChunkCounts);
  if (pairs > 0) {
    count_chunks<<<static_cast<unsigned>(chunks), kThreads, hist_bytes, stream(ctx)>>>(experts, pairs, e_count, chunk,
                                                                                   scratch);
    check_launch(kOp, "count_chunks");
  }
  scan_chunks<<<1, kScanThreads, 0, stream(ctx)>>>(chunks, e_count, capacity, rows, scratch, counts, offsets, dropped);
  check_launch(kOp, "scan_chunks");
  if (pairs == 0) return;
  place_pairs<<<static_cast<unsigned>(chunks), kThreads, ids_bytes, stream(ctx)>>>(experts, pairs, e_count, chunk, scratch,
                                                                              offsets, pair_of_row, row_of_pair);
  check_launch(kOp, "place_pairs");
}

void moe_gather(const ExecContext& ctx, const void* x, DType dtype, int64_t rows, int64_t cols, int64_t k, const int32_t* pair_of_row,
                const int32_t* live, void* grouped) {
  if (rows == 0 || cols == 0) return;
  by_dtype(dtype, vectorizable(cols, {x, grouped}), [&]<typename T, int W>() {
    gather_kernel<T, W><<<row_blocks(rows), kThreads, 0, stream(ctx)>>>(static_cast<const T*>(x), rows, cols, k,
                                                                       pair_of_row, live, static_cast<T*>(grouped));
    check_launch("moe_gather", "gather_kernel");
  });
}

void moe_gather_backward(const ExecContext& ctx, const void* dgrouped, DType dtype, int64_t tokens, int64_t cols, int64_t k,
                         const int32_t* row_of_pair, void* dx, bool accumulate) {
  if (tokens == 0 || cols == 0) return;
  by_dtype(dtype, vectorizable(cols, {dgrouped, dx}), [&]<typename T, int W>() {
    gather_backward_kernel<T, W><<<row_blocks(tokens), kThreads, 0, stream(ctx)>>>(
        static_cast<const T*>(dgrouped), tokens, cols, k, row_of_pair, static_cast<T*>(dx), accumulate);
    check_launch("moe_gather_backward", "gather_backward_kernel");
  });
}

void moe_combine(const ExecContext& ctx, const void* y, DType dtype, const float* weights, int64_t tokens, int64_t cols, int64_t k,
                 const int32_t* row_of_pair, void* out) {
  if (tokens == 0 || cols == 0) return;
  by_dtype(dtype, vectorizable(cols, {y, out}), [&]<typename T, int W>() {
    combine_kernel<T, W><<<row_blocks(tokens), kThreads, 0, stream(ctx)>>>(static_cast<const T*>(y), weights, tokens,
                                                                          cols, k, row_of_pair, static_cast<T*>(out));
    check_launch("moe_combine", "combine_kernel");
  });
}

void moe_combine_backward(const ExecContext& ctx, const void* y, DType dtype, const float* weights, const void* dout, int64_t tokens,
                          int64_t cols, int64_t k, const int32_t* row_of_pair, void* dy, float* dweights) {
  const int64_t pairs = tokens * k;
  if (pairs == 0) return;
  by_dtype(dtype, vectorizable(cols, {y, dout, dy}), [&]<typename T, int W>() {
    combine_backward_kernel<T, W><<<row_blocks(pairs), kThreads, 0, stream(ctx)>>>(
        static_cast<const T*>(y), weights, static_cast<const T*>(dout), pairs, cols, k, row_of_pair,
        static_cast<T*>(dy), dweights);
    check_launch("moe_combine_backward", "combine_backward_kernel");
  });
}

void moe_swiglu_backward(const ExecContext& ctx, const void* gate_up, const void* du, DType dtype, const float* weights,
                         int64_t rows, int64_t f, int64_t pairs, const int32_t* pair_of_row, const int32_t* live,
                         void* dgate_up, void* weighted_act, float* dweights) {
  constexpr const char* kOp = "moe_swiglu_backward";
  if (pairs > 0) check(cudaMemsetAsync(dweights, 0, static_cast<size_t>(pairs) * sizeof(float), stream(ctx)), kOp,
                       "cudaMemsetAsync dweights");
  if (rows == 0 || f == 0) return;
  by_dtype(dtype, vectorizable(f, {gate_up, du, dgate_up, weighted_act}), [&]<typename T, int W>() {
    swiglu_backward_kernel<T, W><<<row_blocks(rows), kThreads, 0, stream(ctx)>>>(
        static_cast<const T*>(gate_up), static_cast<const T*>(du), weights, rows, f, pair_of_row, live,
        static_cast<T*>(dgate_up), static_cast<T*>(weighted_act), dweights);
    check_launch(kOp, "swiglu_backward_kernel");
  });
}

}  // namespace kiln::cuda

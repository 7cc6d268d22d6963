// CUDA kernels of the KV-cache ops; the design is described in cached_attention_cuda.h.
#include "ops/attention/cached_attention_cuda.h"

#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "ops/bf16_vector.cuh"
#include "ops/attention/attention_sink.cuh"
#include "ops/attention/warp_attention.cuh"
#include "ops/dependent_launch.cuh"
#include "ops/block_reduce.cuh"

#include <cuda_bf16.h>

#include <cmath>
#include <type_traits>

namespace kiln::cuda {

namespace {

using bf16 = __nv_bfloat16;

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kTile = static_cast<int>(kHeadTile);
constexpr int kMergeThreads = 128;
constexpr unsigned kFullMask = 0xffffffffu;

using vec::from_f32;
using vec::to_f32;

bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// ---- cache write ----------------------------------------------------------------------------

// Rows are moved as words W (16, 4 or 2 bytes, whatever the row size and pointers allow):
// the write is a scatter of whole rows, so the element type does not matter.
template <typename W>
__global__ void kv_cache_write_kernel(const W* __restrict__ k, const W* __restrict__ v,
                                      const int32_t* __restrict__ slots, const int32_t* __restrict__ positions,
                                      int64_t rows, int64_t row_words, int64_t max_len, W* __restrict__ kc,
                                      W* __restrict__ vc) {
  const int64_t n = rows * row_words;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < n;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = idx / row_words, c = idx - i * row_words;
    const int64_t dst = (static_cast<int64_t>(slots[i]) * max_len + positions[i]) * row_words + c;
    kc[dst] = k[idx];
    vc[dst] = v[idx];
  }
}

template <typename W>
void launch_write(cudaStream_t stream, const void* k, const void* v, const int32_t* slots, const int32_t* positions, int64_t rows,
                  int64_t row_bytes, int64_t max_len, void* kc, void* vc) {
  const int64_t row_words = row_bytes / static_cast<int64_t>(sizeof(W));
  kv_cache_write_kernel<W><<<blocks_for(rows * row_words, 256), 256, 0, stream>>>(
      static_cast<const W*>(k), static_cast<const W*>(v), slots, positions, rows, row_words, max_len,
      static_cast<W*>(kc), static_cast<W*>(vc));
  check_launch("kv_cache_write", "kv_cache_write_kernel");
}

// ---- attention ------------------------------------------------------------------------------

// The positions [first, p] a row at position p sees, cut into `splits` chunks of at least
// kMinSplitLen positions: `used` of them hold any (the rest are empty).
struct SplitPlan {
  int64_t first, chunk, used;
};

__device__ __forceinline__ SplitPlan split_plan(const CachedAttentionArgs& a, int64_t splits, int64_t p) {
  const int64_t first = a.window > 0 ? max(static_cast<int64_t>(0), p - a.window + 1) : 0;
  const int64_t span = p + 1 - first;
  const int64_t chunk = max(kMinSplitLen, (span + splits - 1) / splits);
  return {first, chunk, min(splits, (span + chunk - 1) / chunk)};
}

// What a block of the attention kernels computes: (row, kv head g, head tile) from
// blockIdx.x, split blockIdx.y: query heads h0 .. h0 + nh - 1 over positions [begin, end).
struct WorkItem {
  int64_t row, g, h0, begin, end;
  int nh;
};

__device__ __forceinline__ WorkItem work_item(const CachedAttentionArgs& a, int64_t tiles, int64_t splits) {
  // 32-bit index arithmetic: grid.x < 2^31, and 64-bit division costs dozens of instructions
  // in a kernel bound by its instruction latency.
  const auto b = static_cast<uint32_t>(blockIdx.x), t32 = static_cast<uint32_t>(tiles);
  const auto kv = static_cast<uint32_t>(a.kv_heads);
  const int64_t tile = b % t32, g = (b / t32) % kv, row = (b / t32) / kv;
  const int64_t group = a.q_heads / a.kv_heads;
  WorkItem w{};
  w.row = row, w.g = g, w.h0 = g * group + tile * kTile;
  w.nh = static_cast<int>(min(static_cast<int64_t>(kTile), group - tile * kTile));
  const int64_t p = a.positions[row];
  const SplitPlan plan = split_plan(a, splits, p);
  w.begin = plan.first + static_cast<int64_t>(blockIdx.y) * plan.chunk;
  w.end = min(p + 1, w.begin + plan.chunk);
  return w;
}

// One block per (row, kv head, head tile) and split s = blockIdx.y. Lane l of a warp holds
// elements c = l + 32 e (e < P) of every vector it touches: q of the tile's heads, K and V
// rows, the accumulators. Each warp takes U consecutive positions at a time (their loads
// in flight together), reduces the U x kTile dot products across lanes, and folds them
// into its online softmax; the block then merges its warps through shared memory.
template <typename T, int P>
__global__ void __launch_bounds__(kThreads)
    cached_attention_kernel(CachedAttentionArgs a, int64_t tiles, int64_t splits, const T* __restrict__ q,
                            const T* __restrict__ kc, const T* __restrict__ vc, T* __restrict__ out,
                            float* __restrict__ ws) {
  constexpr int U = P <= 4 ? 4 : (P == 8 ? 2 : 1);
  extern __shared__ float merge[];  // [kWarps][kTile][D + 2]: max, sum, accumulator
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
  const int64_t d = a.head_dim, split = blockIdx.y;
  const WorkItem w = work_item(a, tiles, splits);
  const int64_t g = w.g, row = w.row, h0 = w.h0, begin = w.begin, end = w.end;
  const int nh = w.nh;
  float* partial = ws + ((row * a.q_heads + h0) * splits + split) * (d + 2);  // valid when splits > 1
  if (begin >= end) {  // an empty split (only when splits > 1: a row always sees itself)
    if (threadIdx.x < static_cast<unsigned>(nh)) {
      partial[threadIdx.x * splits * (d + 2)] = -INFINITY;
      partial[threadIdx.x * splits * (d + 2) + 1] = 0.0f;
    }
    return;
  }

  const int64_t stride = a.kv_heads * d;  // elements between positions of one slot
  const int64_t base = (static_cast<int64_t>(a.slots[row]) * a.max_len * a.kv_heads + g) * d;
  const T* kbase = kc + base;
  const T* vbase = vc + base;

  float qv[kTile][P], acc[kTile][P], m[kTile], l[kTile];
#pragma unroll
  for (int t = 0; t < kTile; ++t) {
    m[t] = -INFINITY, l[t] = 0.0f;
#pragma unroll
    for (int e = 0; e < P; ++e) {
      const int64_t c = lane + 32 * e;
      qv[t][e] = t < nh && c < d ? to_f32(q[((row * a.q_heads) + h0 + t) * d + c]) : 0.0f;
      acc[t][e] = 0.0f;
    }
  }

  for (int64_t j0 = begin + warp * U; j0 < end; j0 += kWarps * U) {
    float kf[U][P], vf[U][P];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const bool valid = j0 + u < end;
#pragma unroll
      for (int e = 0; e < P; ++e) {
        const int64_t c = lane + 32 * e;
        const bool in = valid && c < d;
        kf[u][e] = in ? to_f32(kbase[(j0 + u) * stride + c]) : 0.0f;
        vf[u][e] = in ? to_f32(vbase[(j0 + u) * stride + c]) : 0.0f;
      }
    }
    float sc[U][kTile];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int t = 0; t < kTile; ++t) {
        float sum = 0.0f;
#pragma unroll
        for (int e = 0; e < P; ++e) sum += qv[t][e] * kf[u][e];
        sc[u][t] = sum;
      }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1)
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int t = 0; t < kTile; ++t) sc[u][t] += __shfl_xor_sync(kFullMask, sc[u][t], offset);
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int t = 0; t < kTile; ++t) {
        float x = sc[u][t] * a.scale;
        if (a.softcap > 0.0f) x = tanhf(x / a.softcap) * a.softcap;
        sc[u][t] = j0 + u < end ? x : -INFINITY;
      }
#pragma unroll
    for (int t = 0; t < kTile; ++t) {
      if (t >= nh) continue;
      float mx = m[t];
#pragma unroll
      for (int u = 0; u < U; ++u) mx = fmaxf(mx, sc[u][t]);  // finite: position j0 is valid
      const float correction = expf(m[t] - mx);             // 0 while m is still -inf
      float pu[U], sum = 0.0f;
#pragma unroll
      for (int u = 0; u < U; ++u) pu[u] = expf(sc[u][t] - mx), sum += pu[u];
      l[t] = l[t] * correction + sum;
#pragma unroll
      for (int e = 0; e < P; ++e) {
        float x = acc[t][e] * correction;
#pragma unroll
        for (int u = 0; u < U; ++u) x += pu[u] * vf[u][e];
        acc[t][e] = x;
      }
      m[t] = mx;
    }
  }

  const int64_t width = d + 2;
#pragma unroll
  for (int t = 0; t < kTile; ++t) {
    float* slot = merge + (warp * kTile + t) * width;
    if (lane == 0) slot[0] = m[t], slot[1] = l[t];
#pragma unroll
    for (int e = 0; e < P; ++e)
      if (lane + 32 * e < d) slot[2 + lane + 32 * e] = acc[t][e];
  }
  __syncthreads();
  for (int64_t idx = threadIdx.x; idx < nh * d; idx += kThreads) {
    const int64_t t = idx / d, c = idx - t * d;
    float mx = -INFINITY;
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, merge[(w * kTile + t) * width]);
    float sum = 0.0f, x = 0.0f;
    for (int w = 0; w < kWarps; ++w) {
      const float* slot = merge + (w * kTile + t) * width;
      if (slot[0] == -INFINITY) continue;  // a warp that saw no position
      const float f = expf(slot[0] - mx);
      sum += slot[1] * f;
      x += slot[2 + c] * f;
    }
    if (splits == 1) {
      const SinkNormalizer sink = sink_normalizer(mx, sum, a.sinks, h0 + t);
      from_f32(x * sink.scale / sink.denominator, &out[(row * a.q_heads + h0 + t) * d + c]);
    } else {
      float* dst = partial + t * splits * width;
      if (c == 0) dst[0] = mx, dst[1] = sum;
      dst[2 + c] = x;
    }
  }
}

// ---- attention, one warp per block (head_dim 64, 128 or 256) --------------------------------

// N consecutive elements (N = 2, 4 or 8; aligned to N elements) as fp32.
template <int N, typename T>
__device__ __forceinline__ void load_n(const T* p, float (&v)[N]) {
  if constexpr (N == 8) {
    vec::load8(p, v);
  } else if constexpr (std::is_same_v<T, float>) {
    if constexpr (N == 4) {
      const float4 f = *reinterpret_cast<const float4*>(p);
      v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
    } else {
      const float2 f = *reinterpret_cast<const float2*>(p);
      v[0] = f.x, v[1] = f.y;
    }
  } else {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(p);
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      const float2 f = __bfloat1622float2(h[i]);
      v[2 * i] = f.x, v[2 * i + 1] = f.y;
    }
  }
}


// The same work items, splits and outputs as cached_attention_kernel, with one warp per
// block that takes its positions 32 at a time: lane l scores position j0 + l against the
// tile's query heads (q staged in shared memory, read as broadcasts), the warp folds the
// 32 scores into its online softmax, then accumulates P V with lane l owning dims
// [l DPL, (l + 1) DPL). Each lane's dot product runs over whole K rows in registers, so a
// round costs a few hundred instructions where the per-dimension layout spends thousands
// on cross-lane sums; at decode sizes the kernel is bound by that instruction latency.
template <typename T, int DPL>
__global__ void __launch_bounds__(32)
    warp_attention_kernel(CachedAttentionArgs a, int64_t tiles, int64_t splits, const T* __restrict__ q,
                          const T* __restrict__ kc, const T* __restrict__ vc, T* __restrict__ out,
                          float* __restrict__ ws) {
  constexpr int D = 32 * DPL;
  __shared__ __align__(16) float qs[kTile][D];
  __shared__ float ps[kTile][32];
  allow_dependents();
  wait_for_producer();
  const int lane = static_cast<int>(threadIdx.x);
  const int64_t split = blockIdx.y;
  const WorkItem w = work_item(a, tiles, splits);
  const int64_t g = w.g, row = w.row, h0 = w.h0, begin = w.begin, end = w.end;
  const int nh = w.nh;
  float* partial = ws + ((row * a.q_heads + h0) * splits + split) * (D + 2);
  if (begin >= end) {
    if (lane < nh) partial[lane * splits * (D + 2)] = -INFINITY, partial[lane * splits * (D + 2) + 1] = 0.0f;
    return;
  }
  const int64_t stride = a.kv_heads * D;
  const int64_t base = (static_cast<int64_t>(a.slots[row]) * a.max_len * a.kv_heads + g) * D;
  const T* kbase = kc + base;
  const T* vbase = vc + base;

#pragma unroll
  for (int t = 0; t < kTile; ++t) {
    float v[DPL] = {};
    if (t < nh) load_n<DPL>(q + (row * a.q_heads + h0 + t) * D + lane * DPL, v);
#pragma unroll
    for (int e = 0; e < DPL; ++e) qs[t][lane * DPL + e] = v[e];
  }
  __syncwarp();

  float m[kTile], l[kTile], acc[kTile][DPL];
#pragma unroll
  for (int t = 0; t < kTile; ++t) {
    m[t] = -INFINITY, l[t] = 0.0f;
#pragma unroll
    for (int e = 0; e < DPL; ++e) acc[t][e] = 0.0f;
  }
  // V rows in batches of kBatch positions, each batch's loads issued together; the first
  // batch of a round goes out with the K rows, before any score is computed.
  constexpr int kBatch = 64 / DPL;                     // V registers per lane: 64
  constexpr int kPerVec = 16 / static_cast<int>(sizeof(T));  // elements per 16-byte load
  constexpr int kVecs = D / kPerVec, kChunkVecs = kVecs < 16 ? kVecs : 16;
  auto load_v = [&](const T* vrow, int from, int count, float (&vf)[kBatch][DPL]) {
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      if (from + i < count) {
        load_n<DPL>(vrow + (from + i) * stride, vf[i]);
      } else {
#pragma unroll
        for (int e = 0; e < DPL; ++e) vf[i][e] = 0.0f;
      }
    }
  };
  for (int64_t j0 = begin; j0 < end; j0 += 32) {
    const int64_t j = j0 + lane;
    const bool valid = j < end;
    const int count = static_cast<int>(min(static_cast<int64_t>(32), end - j0));
    const T* vrow = vbase + j0 * stride + lane * DPL;
    const T* krow = kbase + (valid ? j : j0) * stride;  // a lane past the end reads a valid row, unused
    // K row j in chunks of up to 16 16-byte loads, all in flight together (the first with
    // the first batch of V rows).
    float sc[kTile] = {};
    float vf[kBatch][DPL];
#pragma unroll
    for (int c = 0; c < kVecs; c += kChunkVecs) {
      uint4 raw[kChunkVecs];
#pragma unroll
      for (int i = 0; i < kChunkVecs; ++i) raw[i] = reinterpret_cast<const uint4*>(krow)[c + i];
      if (c == 0) load_v(vrow, 0, count, vf);
#pragma unroll
      for (int i = 0; i < kChunkVecs; ++i) {
        float kf[kPerVec];
        warp_attention::unpack<T>(raw[i], kf);
        warp_attention::add_scores<kTile>(&qs[0][0], D, (c + i) * kPerVec, kf, nh, sc);
      }
    }
    warp_attention::fold_scores<kTile, DPL>(sc, valid, a.scale, a.softcap, nh, m, l, acc, &ps[0][0]);
    __syncwarp();
    warp_attention::accumulate_pv<kTile, DPL>(&ps[0][0], 0, count, vf, nh, acc);
    for (int from = kBatch; from < count; from += kBatch) {
      load_v(vrow, from, count, vf);
      warp_attention::accumulate_pv<kTile, DPL>(&ps[0][0], from, count, vf, nh, acc);
    }
    __syncwarp();  // ps is rewritten by the next round
  }

#pragma unroll
  for (int t = 0; t < kTile; ++t) {
    if (t >= nh) break;
    if (splits == 1) {
      T* dst = out + (row * a.q_heads + h0 + t) * D + lane * DPL;
      const SinkNormalizer sink = sink_normalizer(m[t], l[t], a.sinks, h0 + t);
#pragma unroll
      for (int e = 0; e < DPL; ++e) from_f32(acc[t][e] * sink.scale / sink.denominator, dst + e);
    } else {
      float* dst = partial + t * splits * (D + 2);
      if (lane == 0) dst[0] = m[t], dst[1] = l[t];
#pragma unroll
      for (int e = 0; e < DPL; ++e) dst[2 + lane * DPL + e] = acc[t][e];
    }
  }
}

// One block per (row, query head): the splits' partial results merged in split order. Only
// the splits that saw positions are read (the rest are empty by construction: a short
// context in a cache sized for long ones leaves most of them so).
template <typename T>
__global__ void merge_splits_kernel(CachedAttentionArgs a, int64_t splits, const float* __restrict__ ws,
                                    T* __restrict__ out) {
  allow_dependents();
  wait_for_producer();
  const int64_t item = blockIdx.x, d = a.head_dim;
  const int64_t width = d + 2;
  const float* base = ws + item * splits * width;
  const int64_t used = split_plan(a, splits, a.positions[item / a.q_heads]).used;
  float mx = -INFINITY;
  for (int64_t s = 0; s < used; ++s) mx = fmaxf(mx, base[s * width]);
  for (int64_t c = threadIdx.x; c < d; c += blockDim.x) {
    float sum = 0.0f, x = 0.0f;
    for (int64_t s = 0; s < used; ++s) {
      const float* part = base + s * width;
      if (part[0] == -INFINITY) continue;  // an empty split
      const float f = expf(part[0] - mx);
      sum += part[1] * f;
      x += part[2 + c] * f;
    }
    const SinkNormalizer sink = sink_normalizer(mx, sum, a.sinks, item % a.q_heads);
    from_f32(x * sink.scale / sink.denominator, &out[item * d + c]);
  }
}

// Head dims of 32 per lane times 2, 4 or 8 take the one-warp kernel (its loads need the
// caches, q and out 16-byte aligned, as the decoder's are); others the per-dimension one.
template <typename T, int P>
void launch_attention(cudaStream_t stream, const CachedAttentionArgs& a, int64_t splits, const void* q, const void* kc, const void* vc,
                      void* out, float* ws) {
  const int64_t tiles = (a.q_heads / a.kv_heads + kTile - 1) / kTile;
  const dim3 grid(static_cast<unsigned>(a.rows * a.kv_heads * tiles), static_cast<unsigned>(splits));
  const bool warp_kernel = (P == 2 || P == 4 || P == 8) && a.head_dim == 32 * P && aligned(q, 16) &&
                           aligned(kc, 16) && aligned(vc, 16) && aligned(out, 16);
  if constexpr (P == 2 || P == 4 || P == 8) {
    if (warp_kernel) {
      launch_dependent_on(stream, "cached_attention", "warp_attention_kernel", warp_attention_kernel<T, P>, grid, dim3(32), 0,
                       a, tiles, splits, static_cast<const T*>(q), static_cast<const T*>(kc),
                       static_cast<const T*>(vc), static_cast<T*>(out), ws);
    }
  }
  if (!warp_kernel) {
    const size_t smem = sizeof(float) * kWarps * kTile * static_cast<size_t>(a.head_dim + 2);
    cached_attention_kernel<T, P><<<grid, kThreads, smem, stream>>>(
        a, tiles, splits, static_cast<const T*>(q), static_cast<const T*>(kc), static_cast<const T*>(vc),
        static_cast<T*>(out), ws);
    check_launch("cached_attention", "cached_attention_kernel");
  }
  if (splits == 1) return;
  launch_dependent_on(stream, "cached_attention", "merge_splits_kernel", merge_splits_kernel<T>,
                   dim3(static_cast<unsigned>(a.rows * a.q_heads)), dim3(kMergeThreads), 0, a, splits,
                   static_cast<const float*>(ws), static_cast<T*>(out));
}

template <typename T>
void dispatch_head_dim(cudaStream_t stream, const CachedAttentionArgs& a, int64_t splits, const void* q, const void* kc, const void* vc,
                       void* out, float* ws) {
  if (a.head_dim <= 32) return launch_attention<T, 1>(stream, a, splits, q, kc, vc, out, ws);
  if (a.head_dim <= 64) return launch_attention<T, 2>(stream, a, splits, q, kc, vc, out, ws);
  if (a.head_dim <= 128) return launch_attention<T, 4>(stream, a, splits, q, kc, vc, out, ws);
  if (a.head_dim <= 256) return launch_attention<T, 8>(stream, a, splits, q, kc, vc, out, ws);
  if (a.head_dim <= 512) return launch_attention<T, 16>(stream, a, splits, q, kc, vc, out, ws);
  fail("cached_attention", "head_dim {} exceeds 512", a.head_dim);
}

}  // namespace

void kv_cache_write(const ExecContext& ctx, const void* k, const void* v, DType dtype, const int32_t* slots, const int32_t* positions,
                    int64_t rows, int64_t row_elems, int64_t max_len, void* k_cache, void* v_cache) {
  if (rows == 0) return;
  const int64_t row_bytes = row_elems * static_cast<int64_t>(dtype_size(dtype));
  auto fits = [&](size_t word) {
    return row_bytes % static_cast<int64_t>(word) == 0 && aligned(k, word) && aligned(v, word) &&
           aligned(k_cache, word) && aligned(v_cache, word);
  };
  if (fits(16)) return launch_write<uint4>(stream(ctx), k, v, slots, positions, rows, row_bytes, max_len, k_cache, v_cache);
  if (fits(4)) return launch_write<uint32_t>(stream(ctx), k, v, slots, positions, rows, row_bytes, max_len, k_cache, v_cache);
  launch_write<uint16_t>(stream(ctx), k, v, slots, positions, rows, row_bytes, max_len, k_cache, v_cache);
}

void cached_attention_forward(const ExecContext& ctx, const CachedAttentionArgs& a, DType dtype, const void* q, const void* k_cache,
                              const void* v_cache, void* out, float* workspace, int64_t workspace_elems) {
  if (a.rows == 0) return;
  int64_t splits = cached_attention_splits(a.rows, a.q_heads, a.kv_heads, a.max_len);
  if (workspace == nullptr || workspace_elems < a.rows * a.q_heads * splits * (a.head_dim + 2)) splits = 1;
  switch (dtype) {
    case DType::f32: return dispatch_head_dim<float>(stream(ctx), a, splits, q, k_cache, v_cache, out, workspace);
    case DType::bf16: return dispatch_head_dim<bf16>(stream(ctx), a, splits, q, k_cache, v_cache, out, workspace);
    default: fail("cached_attention", "the GPU computes in f32 or bf16, got {}", dtype_name(dtype));
  }
}

}  // namespace kiln::cuda

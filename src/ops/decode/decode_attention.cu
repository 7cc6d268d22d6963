// A decode step's attention in one kernel (declared in ops/decode/decode_kernels.h): what
// qkv_to_cache, cached_attention_forward and its split merge do in three kernels, for steps
// whose rows are distinct sequences. At decode batch sizes each of those kernels costs its
// latency, not its bytes, so the chain of three is most of a block's attention time.
//
// One thread-block cluster of up to kMaxSplits blocks per (row, kv head) (launch).
// Every block applies the q/k norms and RoPE itself (a few hundred values; as
// qkv_to_cache_kernel, the same bits) and keeps the group's query heads in shared memory;
// the block whose positions hold the row's own position writes the new k and v into the
// cache. The row's positions are cut into one contiguous range per block; a block's warps
// walk theirs as warp_attention_kernel does (lane l scores position j0 + l, then
// accumulates P V with lane l owning dims [l DPL, (l + 1) DPL)), in rounds of as many
// positions as one batch of V loads holds (16 at head_dim 128), so each round's loads all
// go out before it computes (the next round's while this one finishes); the block
// merges its warps and writes the result into block 0's shared memory (distributed shared
// memory; the other blocks then exit without waiting), and block 0 merges the blocks in
// rank order: the same bits every run. Each warp's first K and V loads go out before the
// kernel waits for the projection ahead of it (programmatic dependent launch): the cache
// rows of earlier positions are not written by the kernels ahead; the new row, loaded too
// early, is taken from shared memory instead.
//
// Only for steps whose rows are distinct slots: a row never attends to another row's new
// position of the same step (the decoder keeps other steps on the three kernels).
#include "ops/decode/decode_kernels.h"

#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "ops/attention/attention_sink.cuh"
#include "ops/attention/warp_attention.cuh"
#include "ops/dependent_launch.cuh"
#include "ops/block_reduce.cuh"

#include <cooperative_groups.h>
#include <cuda_bf16.h>

#include <map>
#include <mutex>
#include <utility>

namespace kiln::cuda {

namespace {

namespace cg = cooperative_groups;
using bf16 = __nv_bfloat16;

// Blocks per (row, kv head), one cluster: the portable maximum. (Clusters of 16, allowed
// per kernel on Hopper, were slower on the H200: 0.878 against 0.843 ms at batch 1.)
constexpr int kMaxSplits = 8;
constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900  // (the kernel's helpers; see the kernel)
__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// The cluster barrier in its two halves (every thread of every block arrives once per
// phase): arrive without waiting, releasing this thread's earlier writes (release) or not,
// and wait for the phase to complete (acquiring the writes released into it).
__device__ __forceinline__ void cluster_arrive(bool release) {
  if (release)
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
  else
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }
#endif

// What prepare_head reads besides the head, per lane: the q and k norm gains of elements
// lane + 32 e, and the RoPE cos and sin of pairs lane + 32 i at the row's position. All of
// it is constant during the step (weights, tables, the uploaded position), so it is loaded
// before the kernel waits for the projection ahead: one round of loads less after it.
template <int D>
struct HeadConstants {
  static constexpr int kHalf = D / 2, kPairs = (kHalf + 31) / 32;
  float q_gain[D / 32], k_gain[D / 32], cos[kPairs], sin[kPairs];
};

template <int D>
__device__ __forceinline__ HeadConstants<D> load_head_constants(const DecodeAttentionArgs& a, int64_t pos) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  HeadConstants<D> h;
#pragma unroll
  for (int e = 0; e < D / 32; ++e) {
    h.q_gain[e] = a.q_gain != nullptr ? a.q_gain[lane + 32 * e] : 1.0f;
    h.k_gain[e] = a.k_gain != nullptr ? a.k_gain[lane + 32 * e] : 1.0f;
  }
  constexpr int kHalf = HeadConstants<D>::kHalf;
#pragma unroll
  for (int i = 0, j = lane; j < kHalf; ++i, j += 32) {
    h.cos[i] = a.cos != nullptr ? a.cos[pos * kHalf + j] : 1.0f;
    h.sin[i] = a.cos != nullptr ? a.sin[pos * kHalf + j] : 0.0f;
  }
  return h;
}

// One query or key head of a row of qkv (src: its D values) normalized with `gain` (lane
// l's elements l + 32 e; no norm when `normalize` is false) and rotated by the RoPE angles
// of h (none when a.cos is null), as qkv_to_cache_kernel does, by one warp. The result,
// rounded to bf16 as a stored head would be, ends in `pairs` (the warp's D floats).
template <int D>
__device__ __forceinline__ void prepare_head(const DecodeAttentionArgs& a, const bf16* src, bool normalize,
                                             const float (&gain)[D / 32], const HeadConstants<D>& h, float* pairs) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  float ss = 0.0f;
#pragma unroll
  for (int c = lane; c < D; c += 32) {
    const float v = __bfloat162float(src[c]);
    pairs[c] = v;
    ss += v * v;
  }
  if (normalize) {
    const float inv = 1.0f / sqrtf(warp_sum(ss) / static_cast<float>(D) + a.eps);
#pragma unroll
    for (int e = 0, c = lane; c < D; ++e, c += 32) pairs[c] = round_bf16(pairs[c] * inv * gain[e]);
  }
  __syncwarp();
  if (a.cos == nullptr) return;
  constexpr int kHalf = D / 2;
  float rotated[2][HeadConstants<D>::kPairs];
#pragma unroll
  for (int i = 0, j = lane; j < kHalf; ++i, j += 32) {
    const float x1 = pairs[j], x2 = pairs[j + kHalf];
    const float c = h.cos[i], s = h.sin[i];
    rotated[0][i] = round_bf16(x1 * c - x2 * s);
    rotated[1][i] = round_bf16(x2 * c + x1 * s);
  }
  __syncwarp();
#pragma unroll
  for (int i = 0, j = lane; j < kHalf; ++i, j += 32) pairs[j] = rotated[0][i], pairs[j + kHalf] = rotated[1][i];
  __syncwarp();
}

// DPL = head_dim / 32 values per lane, HT = query heads per kv head. Launched in clusters
// of `splits` blocks along x (launch_dependent_clusters).
template <int DPL, int HT, int MinBlocks>
__global__ void __launch_bounds__(kThreads, MinBlocks) decode_attention_kernel(const DecodeAttentionArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  __trap();  // clusters are sm_90 and later: decode_attention_fits is false on older GPUs
#else
  constexpr int D = 32 * DPL;
  // Positions per warp round: as many V rows as 64 registers per lane hold (16 at head_dim
  // 128), so a round's V rows are one batch of loads, all of it issued ahead.
  constexpr int kRound = 64 / DPL < 32 ? 64 / DPL : 32;
  constexpr int kVecs = D / 8, kChunkVecs = kVecs < 16 ? kVecs : 16;  // a K row in chunks of 16-byte loads
  __shared__ __align__(16) float qs[HT][D];
  __shared__ __align__(16) float scratch[kWarps][D];  // prepare_head's pairs
  __shared__ __align__(16) bf16 fresh_k[D], fresh_v[D];  // the row's own k and v, as written to the cache
  __shared__ float ps[kWarps][HT][32];
  __shared__ float warp_ml[kWarps][HT][2];
  __shared__ __align__(16) float warp_acc[kWarps][HT][D];
  // Block 0's inbox: each block's merged (max, sum) and accumulators, written there by the
  // block itself through distributed shared memory; the accumulators [splits][HT][D] are
  // the dynamic shared memory (partials_bytes).
  __shared__ float inbox_ml[kMaxSplits][HT][2];
  extern __shared__ __align__(16) float inbox_acc[];

  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank()), splits = static_cast<int>(cluster.num_blocks());
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
  // The cluster's index from its register and 32-bit divisions: no 64-bit division (a long
  // dependent chain) ahead of the first loads.
  unsigned cluster_id;
  asm("mov.u32 %0, %%clusterid.x;" : "=r"(cluster_id));
  const int item = static_cast<int>(cluster_id), kv_heads = static_cast<int>(a.kv_heads);
  const int64_t row = item / kv_heads, g = item - (item / kv_heads) * kv_heads;
  allow_dependents();
  cluster_arrive(false);  // this block has started: waited for before block 0's inbox is written

  // Before waiting for the kernels ahead: the step's inputs (uploaded before the step) and
  // the cache rows of earlier positions are nothing they write, so the first round's K and
  // V loads go out now, overlapping their tail.
  const int64_t p = a.positions[row];
  const int64_t first = a.window > 0 ? max(static_cast<int64_t>(0), p - a.window + 1) : 0;
  const int64_t span = p + 1 - first, chunk = static_cast<int>(span + splits - 1) / splits;
  const int64_t begin = min(p + 1, first + rank * chunk), end = min(p + 1, begin + chunk);
  const bool owns_new = begin <= p && p < end;  // this block's range holds the row's own position
  const int64_t stride = a.kv_heads * D;        // elements between positions of one slot
  const int64_t slot_base = (static_cast<int64_t>(a.slots[row]) * a.max_len * a.kv_heads + g) * D;
  // Plain pointers, not const __restrict__: the new row is read back after its write.
  bf16* kbase = static_cast<bf16*>(a.k_cache) + slot_base;
  bf16* vbase = static_cast<bf16*>(a.v_cache) + slot_base;

  // A round: positions j0 .. j0 + kRound - 1 of this warp. Its head (the first chunk of lane
  // l's K row j0 + l and the round's V rows) is loaded ahead, the rest of the K rows (past
  // 128 dims) in the round.
  auto load_v = [&](int64_t j0, int count, float (&vf)[kRound][DPL]) {
#pragma unroll
    for (int i = 0; i < kRound; ++i) {
      if (i < count) {
        const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(vbase + (j0 + i) * stride + lane * DPL);
#pragma unroll
        for (int e = 0; e < DPL / 2; ++e) {
          const float2 f = __bfloat1622float2(h[e]);
          vf[i][2 * e] = f.x, vf[i][2 * e + 1] = f.y;
        }
      } else {
#pragma unroll
        for (int e = 0; e < DPL; ++e) vf[i][e] = 0.0f;
      }
    }
  };
  // Lane l's K row: position j0 + l; lanes past the round or the range read a row of it
  // again (the same address as a neighbour: no extra traffic), unused.
  auto k_row = [&](int64_t j0) { return kbase + min(j0 + min(lane, kRound - 1), end - 1) * stride; };
  auto load_head = [&](int64_t j0, uint4 (&k_head)[kChunkVecs], float (&vf)[kRound][DPL]) {
    const uint4* krow = reinterpret_cast<const uint4*>(k_row(j0));
#pragma unroll
    for (int i = 0; i < kChunkVecs; ++i) k_head[i] = krow[i];
    load_v(j0, static_cast<int>(min(static_cast<int64_t>(kRound), end - j0)), vf);
  };
  const int64_t round_step = kRound * kWarps;
  int64_t j0 = begin + kRound * warp;
  uint4 k_head[kChunkVecs];
  float vf[kRound][DPL];
  if (j0 < end) load_head(j0, k_head, vf);
  const HeadConstants<D> constants = load_head_constants<D>(a, p);

  wait_for_producer();  // qkv comes from the projection before

  // The group's query heads into qs; k and v of the new position into the cache (its owner).
  const int64_t heads = a.q_heads + 2 * a.kv_heads, h0 = g * HT;
  const bf16* src_row = static_cast<const bf16*>(a.qkv) + row * heads * D;
  for (int it = warp; it < HT + 2; it += kWarps) {
    float* pairs = scratch[warp];
    if (it < HT) {
      prepare_head<D>(a, src_row + (h0 + it) * D, a.q_gain != nullptr, constants.q_gain, constants, pairs);
#pragma unroll
      for (int c = lane; c < D; c += 32) qs[it][c] = pairs[c];
    } else if (it == HT) {
      prepare_head<D>(a, src_row + (a.q_heads + g) * D, a.k_gain != nullptr, constants.k_gain, constants, pairs);
      if (owns_new)
#pragma unroll
        for (int c = lane; c < D; c += 32) {
          const bf16 k = __float2bfloat16_rn(pairs[c]);
          kbase[p * stride + c] = k;
          fresh_k[c] = k;
        }
    } else if (owns_new) {
      const bf16* v = src_row + (a.q_heads + a.kv_heads + g) * D;
#pragma unroll
      for (int c = lane; c < D; c += 32) {
        const bf16 x = v[c];
        vbase[p * stride + c] = x;
        fresh_v[c] = x;
      }
    }
  }
  __syncthreads();  // qs and the new cache rows, visible to the whole block

  float m[HT], l[HT], acc[HT][DPL];
#pragma unroll
  for (int t = 0; t < HT; ++t) {
    m[t] = -INFINITY, l[t] = 0.0f;
#pragma unroll
    for (int e = 0; e < DPL; ++e) acc[t][e] = 0.0f;
  }
  for (; j0 < end; j0 += round_step) {
    const int count = static_cast<int>(min(static_cast<int64_t>(kRound), end - j0));
    const bool valid = lane < count;
    // The head of the first round was loaded before the new row was written: take that
    // row from shared memory. (Later loads come after the barrier above and see it.)
    if (owns_new && p >= j0 && p < j0 + kRound) {
      if (lane == p - j0)
#pragma unroll
        for (int i = 0; i < kChunkVecs; ++i) k_head[i] = reinterpret_cast<const uint4*>(fresh_k)[i];
#pragma unroll
      for (int i = 0; i < kRound; ++i)  // a constant index: vf stays in registers
        if (i == p - j0)
#pragma unroll
          for (int e = 0; e < DPL; ++e) vf[i][e] = __bfloat162float(fresh_v[lane * DPL + e]);
    }
    float sc[HT] = {};
    const uint4* krow = reinterpret_cast<const uint4*>(k_row(j0));
#pragma unroll
    for (int c = 0; c < kVecs; c += kChunkVecs) {
      uint4 raw[kChunkVecs];
#pragma unroll
      for (int i = 0; i < kChunkVecs; ++i) raw[i] = c == 0 ? k_head[i] : krow[c + i];
#pragma unroll
      for (int i = 0; i < kChunkVecs; ++i) {
        float kf[8];
        warp_attention::unpack<bf16>(raw[i], kf);
        warp_attention::add_scores<HT>(&qs[0][0], D, (c + i) * 8, kf, HT, sc);
      }
    }
    float* probabilities = &ps[warp][0][0];
    warp_attention::fold_scores<HT, DPL>(sc, valid, a.scale, a.softcap, HT, m, l, acc, probabilities);
    __syncwarp();
    warp_attention::accumulate_pv<HT, DPL>(probabilities, 0, count, vf, HT, acc);
    __syncwarp();  // ps is rewritten by the next round
    if (j0 + round_step < end) load_head(j0 + round_step, k_head, vf);
  }

  // The block's warps merged in warp order (a warp that saw no position has m = -inf),
  // straight into block 0's inbox once every block of the cluster is known to have started.
#pragma unroll
  for (int t = 0; t < HT; ++t) {
    if (lane == 0) warp_ml[warp][t][0] = m[t], warp_ml[warp][t][1] = l[t];
#pragma unroll
    for (int e = 0; e < DPL; ++e) warp_acc[warp][t][lane * DPL + e] = acc[t][e];
  }
  __syncthreads();
  cluster_wait();
  float* to_acc = cluster.map_shared_rank(inbox_acc, 0) + rank * HT * D;
  float* to_ml = cluster.map_shared_rank(&inbox_ml[0][0][0], 0) + rank * HT * 2;
  for (int idx = static_cast<int>(threadIdx.x); idx < HT * D; idx += kThreads) {
    const int t = idx / D, c = idx - t * D;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, warp_ml[w][t][0]);
    float sum = 0.0f, x = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      if (warp_ml[w][t][0] == -INFINITY) continue;
      const float f = expf(warp_ml[w][t][0] - mx);
      sum += warp_ml[w][t][1] * f;
      x += warp_acc[w][t][c] * f;
    }
    to_acc[idx] = x;
    if (c == 0) to_ml[2 * t] = mx, to_ml[2 * t + 1] = sum;
  }
  // Released to block 0, which alone waits: no block reads another's shared memory after
  // this, so the others may exit now (block 0's stays until its wait has seen every write).
  cluster_arrive(true);
  if (rank != 0) return;
  cluster_wait();
  for (int idx = static_cast<int>(threadIdx.x); idx < HT * D; idx += kThreads) {
    const int t = idx / D, c = idx - t * D;
    float mx = -INFINITY;
    for (int r = 0; r < splits; ++r) mx = fmaxf(mx, inbox_ml[r][t][0]);
    float sum = 0.0f, x = 0.0f;
    for (int r = 0; r < splits; ++r) {
      if (inbox_ml[r][t][0] == -INFINITY) continue;  // a block that saw no position
      const float f = expf(inbox_ml[r][t][0] - mx);
      sum += inbox_ml[r][t][1] * f;
      x += inbox_acc[(r * HT + t) * D + c] * f;
    }
    const SinkNormalizer sink = sink_normalizer(mx, sum, a.sinks, h0 + t);
    const float y = x * sink.scale / sink.denominator;
    static_cast<bf16*>(a.out)[(row * a.q_heads + h0 + t) * D + c] = __float2bfloat16_rn(y);
  }
#endif
}

// Dynamic shared memory of a block: block 0's inbox of accumulators.
template <int DPL, int HT>
constexpr size_t partials_bytes(int splits) {
  return sizeof(float) * static_cast<size_t>(splits) * HT * 32 * DPL;
}

// Clusters of `splits` blocks of `kernel` with `smem` bytes of dynamic shared memory the
// GPU holds at once (asked once per kernel and size: clusters live within one GPC, so this
// is less than the SM count suggests). Also lifts the kernel's dynamic shared memory limit
// to what kMaxSplits blocks need.
template <typename Kernel>
int64_t resident_clusters(Kernel kernel, int splits, size_t smem, size_t most_smem) {
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, int64_t> known;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_pair(reinterpret_cast<const void*>(kernel), splits);
  if (auto it = known.find(key); it != known.end()) return it->second;
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(most_smem)),
        "decoder", "cudaFuncSetAttribute");
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = static_cast<unsigned>(splits);
  attribute.val.clusterDim.y = attribute.val.clusterDim.z = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(splits));
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = smem;
  config.attrs = &attribute;
  config.numAttrs = 1;
  int clusters = 0;
  check(cudaOccupancyMaxActiveClusters(&clusters, kernel, &config), "decoder", "cudaOccupancyMaxActiveClusters");
  known.emplace(key, clusters);
  return clusters;
}

// Blocks per (row, kv head), the cluster's size: up to kMaxSplits (a row's positions spread
// over the GPU at batch 1), halved while the GPU could not hold all the clusters at once
// (on the H200 a batch-4 step on 32 clusters of 8 took longer than a batch-5 step on 40
// clusters of 4: the clusters that did not fit waited for a second wave).
// Two builds of the kernel: one free to use registers (204 per thread at the 0.6B shape,
// two blocks per SM) where every cluster fits at the largest size anyway (small batches),
// and one held to three blocks per SM (168) where more clusters must fit. Measured on the
// H200 (0.6B, chains of 16): the free build 0.698 against 0.707 ms per step at batch 1;
// used at batch 8 too, 1.085 against 1.018 ms (fewer clusters resident, smaller clusters).
// The dense build's blocks per SM: three where the registers allow it (ptxas -v for sm_90a:
// head_dim 64 or 128 with at most 8 query values per lane, no spills but 4 bytes at head_dim
// 64 and groups of 4), else as the free build.
constexpr int dense_min_blocks(int dpl, int ht) { return dpl <= 4 && dpl * ht <= 8 ? 3 : 1; }

template <int DPL, int HT>
void launch(cudaStream_t s, const DecodeAttentionArgs& a) {
  const int64_t items = a.rows * a.kv_heads;
  auto roomy = decode_attention_kernel<DPL, HT, 1>;
  auto dense = decode_attention_kernel<DPL, HT, dense_min_blocks(DPL, HT)>;
  auto resident = [&](auto kernel, int splits) {
    return resident_clusters(kernel, splits, partials_bytes<DPL, HT>(splits), partials_bytes<DPL, HT>(kMaxSplits));
  };
  if (items <= resident(roomy, kMaxSplits)) {
    launch_dependent_clusters_on(s, "decoder", "decode_attention_kernel", roomy,
                              dim3(static_cast<unsigned>(items * kMaxSplits)), dim3(kThreads),
                              partials_bytes<DPL, HT>(kMaxSplits), static_cast<unsigned>(kMaxSplits), a);
    return;
  }
  int splits = kMaxSplits;
  while (splits > 1 && items > resident(dense, splits)) splits /= 2;
  launch_dependent_clusters_on(s, "decoder", "decode_attention_kernel", dense, dim3(static_cast<unsigned>(items * splits)),
                            dim3(kThreads), partials_bytes<DPL, HT>(splits), static_cast<unsigned>(splits), a);
}

template <int DPL>
void dispatch_group(cudaStream_t s, const DecodeAttentionArgs& a) {
  switch (a.q_heads / a.kv_heads) {
    case 1: return launch<DPL, 1>(s, a);
    case 2: return launch<DPL, 2>(s, a);
    case 4: return launch<DPL, 4>(s, a);
    case 8:
      if constexpr (DPL <= 4) return launch<DPL, 8>(s, a);
      break;
    default: break;
  }
}

}  // namespace

bool decode_attention_fits(int64_t q_heads, int64_t kv_heads, int64_t head_dim) {
  static const bool clusters = [] {  // thread-block clusters: sm_90 and later
    int device = 0, supported = 0;
    check(cudaGetDevice(&device), "decoder", "cudaGetDevice");
    check(cudaDeviceGetAttribute(&supported, cudaDevAttrClusterLaunch, device), "decoder", "cudaDeviceGetAttribute");
    return supported != 0;
  }();
  if (!clusters || kv_heads < 1 || q_heads % kv_heads != 0) return false;
  const int64_t group = q_heads / kv_heads;
  // group x head_dim <= 1024 keeps the static shared memory (queries, warp partials) under 48 KiB.
  return (group == 1 || group == 2 || group == 4 || group == 8) &&
         (head_dim == 64 || head_dim == 128 || head_dim == 256) && group * head_dim <= 1024;
}

void decode_attention(const ExecContext& ctx, const DecodeAttentionArgs& a) {
  if (a.rows == 0) return;
  if (!decode_attention_fits(a.q_heads, a.kv_heads, a.head_dim))
    fail("decoder", "decode attention: {} query heads over {} kv heads of {} (see decode_attention_fits)", a.q_heads,
         a.kv_heads, a.head_dim);
  if (a.head_dim == 64) return dispatch_group<2>(stream(ctx), a);
  if (a.head_dim == 128) return dispatch_group<4>(stream(ctx), a);
  dispatch_group<8>(stream(ctx), a);  // head_dim 256: groups of at most 4 (fits)
}

}  // namespace kiln::cuda

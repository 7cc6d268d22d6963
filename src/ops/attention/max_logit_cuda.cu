// Per-head maximum attention logits on the GPU (max_logit_cuda.h).
//
// bf16 on tensor cores: one block takes consecutive packed rows (queries) of one head, four
// warps of 32 rows each (16 at head_dim 256) holding their queries as WMMA fragments, and walks the keys
// its rows may see (from the first row's sequence start, or its window, to its last row)
// in tiles of 64, each tile copied into shared memory asynchronously while the previous
// one is multiplied. A warp whose 16 rows see every key of a tile (below the diagonal, one
// sequence, inside the window: most tiles) takes the maximum straight from its
// accumulators, whatever their layout; only the tiles on a diagonal, a sequence boundary
// or a window's edge go through shared memory to be masked element by element. The
// block's maximum joins the head's running key with one atomicMax (logit_key.h), so the
// result does not depend on block order.
#include "ops/attention/max_logit_cuda.h"

#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "ops/attention/logit_key.h"

#include <cuda_bf16.h>
#include <cuda_pipeline.h>
#include <mma.h>

#include <climits>

namespace kiln::cuda {

namespace {

// A block: kWarps warps, each taking G x 16 query rows, so each key fragment read
// from shared memory feeds Groups products (at head_dim 128, two: shared-memory reads, not
// the tensor cores, bound one group).
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kKeys = 64;  // keys per tile

template <int D>
constexpr int groups_of() { return D <= 128 ? 2 : 1; }
template <int D>
constexpr int rows_of() { return kWarps * 16 * groups_of<D>(); }

// The start of row i's sequence (cu_seqlens[s] <= i < cu_seqlens[s + 1]); INT_MAX for a row
// past the last sequence, which then sees no key.
__device__ int sequence_start(const int32_t* __restrict__ cu, int64_t seqs, int64_t i) {
  if (i >= cu[seqs]) return INT_MAX;
  int64_t lo = 0, hi = seqs;  // cu[lo] <= i < cu[hi]
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (cu[mid] <= i) lo = mid; else hi = mid;
  }
  return cu[lo];
}

__device__ bool visible(int64_t i, int64_t j, int start, int64_t window) {
  return j <= i && j >= start && (window <= 0 || i - j < window);
}

__device__ float warp_max(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

__device__ void raise_running(uint32_t* running, float best, float scale) {
  if (best > -INFINITY) atomicMax(running, kiln::ops::logit_key_of_bits(__float_as_uint(best * scale)));
}

template <int D>
struct TileLayout {
  static constexpr int kRows = rows_of<D>();
  static constexpr int kLd = D + 8;  // bf16 row stride in shared memory: a multiple of 8, off the banks' period
  static constexpr size_t kQ = size_t{kRows} * kLd * 2, kK = size_t{kKeys} * kLd * 2;
  static constexpr size_t kScores = size_t{kRows} * kKeys * 4;  // the warps' rows x a tile, for masking
  // The queries are read into registers once, before the first tile: their region then
  // holds the scores the masked tiles go through (one block more per SM at head_dim 128).
  static constexpr size_t kShared = kQ > kScores ? kQ : kScores;
  static constexpr size_t kBytes = kShared + 2 * kK + kRows * sizeof(int);
};

// Starts the copy of rows [first, first + count) of one head (row stride `heads` x D) into
// shared memory, 16 bytes per request; rows past `count` are left as they are (masked).
template <int D>
__device__ void start_tile_copy(__nv_bfloat16* dst, const __nv_bfloat16* __restrict__ src, int64_t first, int count,
                                int64_t heads, int64_t head) {
  constexpr int kChunks = D / 8;
  for (int c = threadIdx.x; c < count * kChunks; c += kThreads) {
    const int r = c / kChunks, col = (c % kChunks) * 8;
    __pipeline_memcpy_async(dst + r * TileLayout<D>::kLd + col, src + ((first + r) * heads + head) * D + col, 16);
  }
}

template <int D>
__global__ void __launch_bounds__(kThreads)
    max_logits_wmma_kernel(AttentionArgs a, const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,
                           uint32_t* __restrict__ running) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // bf16 WMMA is sm_80 and later: attention_max_logits_bf16 takes the plain kernel there
#else
  using namespace nvcuda;
  using L = TileLayout<D>;
  constexpr int G = groups_of<D>(), kWarpRows = 16 * G, kRows = L::kRows;
  extern __shared__ __align__(128) unsigned char smem[];
  auto* qs = reinterpret_cast<__nv_bfloat16*>(smem);
  auto* scores = reinterpret_cast<float*>(smem);  // after the queries are in registers
  __nv_bfloat16* ks[2] = {reinterpret_cast<__nv_bfloat16*>(smem + L::kShared),
                          reinterpret_cast<__nv_bfloat16*>(smem + L::kShared + L::kK)};
  auto* starts = reinterpret_cast<int*>(smem + L::kShared + 2 * L::kK);
  const int64_t head = blockIdx.y, kv_head = head / (a.q_heads / a.kv_heads);
  const int64_t r0 = int64_t{blockIdx.x} * kRows;
  const int rows = static_cast<int>(min(static_cast<int64_t>(kRows), a.tokens - r0));
  for (int r = threadIdx.x; r < kRows; r += kThreads)
    starts[r] = r < rows ? sequence_start(a.cu_seqlens, a.num_seqs, r0 + r) : INT_MAX;
  // Queries: rows past the end are zeros (their warps take the masked path).
  constexpr int kChunks = D / 8;
  for (int c = threadIdx.x; c < kRows * kChunks; c += kThreads) {
    const int r = c / kChunks, col = (c % kChunks) * 8;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (r < rows) v = *reinterpret_cast<const uint4*>(q + ((r0 + r) * a.q_heads + head) * D + col);
    *reinterpret_cast<uint4*>(qs + r * L::kLd + col) = v;
  }
  __syncthreads();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wr = warp * kWarpRows;  // the warp's first row in the block
  wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> qf[G][D / 16];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < D / 16; ++c)
      wmma::load_matrix_sync(qf[g][c], qs + (wr + 16 * g) * L::kLd + c * 16, L::kLd);
  // The warp's rows [w0, w1], all in one sequence starting at w_start when w_whole.
  const int64_t w0 = r0 + wr, w1 = w0 + kWarpRows - 1;
  const int w_start = starts[wr];
  const bool w_whole = wr + kWarpRows <= rows && starts[wr + kWarpRows - 1] == w_start;
  // Row starts never decrease with the row, so the first row's is the block's earliest key.
  int64_t first_key = starts[0];
  if (a.window > 0) first_key = max(first_key, r0 - a.window + 1);
  const int64_t end_key = r0 + rows;
  float* my_scores = scores + wr * kKeys;
  float best = -INFINITY;
  if (first_key < end_key) {
    start_tile_copy<D>(ks[0], k, first_key, static_cast<int>(min(static_cast<int64_t>(kKeys), end_key - first_key)),
                       a.kv_heads, kv_head);
    __pipeline_commit();
  }
  int buffer = 0;
  for (int64_t k0 = first_key; k0 < end_key; k0 += kKeys, buffer ^= 1) {
    const int count = static_cast<int>(min(static_cast<int64_t>(kKeys), end_key - k0));
    const int64_t next = k0 + kKeys;
    if (next < end_key)  // the next tile's copy overlaps this tile's products
      start_tile_copy<D>(ks[buffer ^ 1], k, next, static_cast<int>(min(static_cast<int64_t>(kKeys), end_key - next)),
                         a.kv_heads, kv_head);
    __pipeline_commit();
    __pipeline_wait_prior(1);
    __syncthreads();  // the tile is in; the first time, also every warp's queries are in registers
    const int64_t k1 = k0 + count - 1;
    // Whether this warp sees no key of the tile, or every one of them.
    const bool none = k0 > w1 || k1 < w_start || (a.window > 0 && w0 - k1 >= a.window);
    const bool all = w_whole && count == kKeys && k0 >= w_start && k1 <= w0 && (a.window <= 0 || w1 - k0 < a.window);
    if (!none) {
      const __nv_bfloat16* tile = ks[buffer];
      for (int n = 0; n < kKeys / 16; ++n) {
        wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[G];
        for (int g = 0; g < G; ++g) wmma::fill_fragment(acc[g], 0.0f);
        for (int c = 0; c < D / 16; ++c) {
          wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> kf;  // K^T
          wmma::load_matrix_sync(kf, tile + n * 16 * L::kLd + c * 16, L::kLd);
          for (int g = 0; g < G; ++g) wmma::mma_sync(acc[g], qf[g][c], kf, acc[g]);
        }
        for (int g = 0; g < G; ++g) {
          if (all) {
            for (int e = 0; e < acc[g].num_elements; ++e) best = fmaxf(best, acc[g].x[e]);
          } else {
            wmma::store_matrix_sync(my_scores + 16 * g * kKeys + n * 16, acc[g], kKeys, wmma::mem_row_major);
          }
        }
      }
      if (!all) {
        __syncwarp();
        for (int e = lane; e < kWarpRows * kKeys; e += 32) {
          const int r = wr + e / kKeys, c = e % kKeys;
          if (r < rows && c < count && visible(r0 + r, k0 + c, starts[r], a.window)) best = fmaxf(best, my_scores[e]);
        }
        __syncwarp();
      }
    }
    __syncthreads();  // every warp is done with this buffer before the copy after next fills it
  }
  best = warp_max(best);
  if (lane == 0) raise_running(running + head, best, a.scale);
#endif
}

// One warp per (query row, head): its visible keys in turn, the dot split across lanes.
template <typename T>
__global__ void max_logits_plain_kernel(AttentionArgs a, const T* __restrict__ q, const T* __restrict__ k,
                                        uint32_t* __restrict__ running) {
  const int64_t warp = (int64_t{blockIdx.x} * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (warp >= a.tokens * a.q_heads) return;
  const int64_t i = warp / a.q_heads, head = warp % a.q_heads, kv_head = head / (a.q_heads / a.kv_heads);
  const int start = sequence_start(a.cu_seqlens, a.num_seqs, i);
  if (start == INT_MAX) return;
  const int64_t first = a.window > 0 ? max(static_cast<int64_t>(start), i - a.window + 1) : start;
  const T* qi = q + (i * a.q_heads + head) * a.head_dim;
  float best = -INFINITY;
  for (int64_t j = first; j <= i; ++j) {
    const T* kj = k + (j * a.kv_heads + kv_head) * a.head_dim;
    float dot = 0;
    for (int64_t c = lane; c < a.head_dim; c += 32) dot += static_cast<float>(qi[c]) * static_cast<float>(kj[c]);
    for (int offset = 16; offset > 0; offset >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
    best = fmaxf(best, dot);
  }
  if (lane == 0) raise_running(running + head, best, a.scale);
}

__global__ void take_kernel(uint32_t* __restrict__ running, int64_t n, uint32_t* __restrict__ last) {
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    last[i] = running[i];
    running[i] = 0;
  }
}

template <typename T>
void launch_plain(cudaStream_t stream, const char* op, const AttentionArgs& a, const T* q, const T* k, uint32_t* running) {
  const int64_t warps = a.tokens * a.q_heads;
  constexpr int kPlainThreads = 256;
  const auto blocks = static_cast<unsigned>((warps * 32 + kPlainThreads - 1) / kPlainThreads);
  max_logits_plain_kernel<T><<<blocks, kPlainThreads, 0, stream>>>(a, q, k, running);
  check_launch(op, "max_logits_plain_kernel");
}

template <int D>
void launch_wmma(cudaStream_t stream, const AttentionArgs& a, const __nv_bfloat16* q, const __nv_bfloat16* k, uint32_t* running) {
  constexpr size_t bytes = TileLayout<D>::kBytes;
  static const bool configured = [] {
    check(cudaFuncSetAttribute(max_logits_wmma_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(bytes)),
          "attention_max_logits", "cudaFuncSetAttribute");
    return true;
  }();
  (void)configured;
  constexpr int64_t rows = rows_of<D>();
  const dim3 grid(static_cast<unsigned>((a.tokens + rows - 1) / rows), static_cast<unsigned>(a.q_heads));
  max_logits_wmma_kernel<D><<<grid, kThreads, bytes, stream>>>(a, q, k, running);
  check_launch("attention_max_logits", "max_logits_wmma_kernel");
}

// bf16 tensor-core fragments (WMMA) need compute capability 8.0; on a Turing card (sm_75)
// the bf16 path takes the plain kernel. One GPU per process, so read once.
bool bf16_wmma_supported() {
  static const bool supported = [] {
    int device = 0, major = 0;
    check(cudaGetDevice(&device), "attention_max_logits", "cudaGetDevice");
    check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "attention_max_logits",
          "compute capability");
    return major >= 8;
  }();
  return supported;
}

}  // namespace

void attention_max_logits_bf16(const ExecContext& ctx, const AttentionArgs& a, const bf16_bits* q, const bf16_bits* k, uint32_t* running) {
  if (a.tokens == 0) return;
  const auto* qb = reinterpret_cast<const __nv_bfloat16*>(q);
  const auto* kb = reinterpret_cast<const __nv_bfloat16*>(k);
  if (!bf16_wmma_supported()) return launch_plain(stream(ctx), "attention_max_logits", a, qb, kb, running);
  switch (a.head_dim) {
    case 64: return launch_wmma<64>(stream(ctx), a, qb, kb, running);
    case 128: return launch_wmma<128>(stream(ctx), a, qb, kb, running);
    case 256: return launch_wmma<256>(stream(ctx), a, qb, kb, running);
    default: return launch_plain(stream(ctx), "attention_max_logits", a, qb, kb, running);
  }
}

void attention_max_logits_f32(const ExecContext& ctx, const AttentionArgs& a, const float* q, const float* k, uint32_t* running) {
  if (a.tokens == 0) return;
  launch_plain(stream(ctx), "attention_max_logits", a, q, k, running);
}

void take_max_logits(const ExecContext& ctx, uint32_t* running, int64_t n, uint32_t* last) {
  if (n == 0) return;
  take_kernel<<<1, 128, 0, stream(ctx)>>>(running, n, last);
  check_launch("take_max_logits", "take_kernel");
}

}  // namespace kiln::cuda

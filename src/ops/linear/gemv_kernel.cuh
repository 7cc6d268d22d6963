// The skinny-product kernel: out [m, n] from A [m, k] (m <= 8 rows, the tokens of a decode
// step) times a bf16 weight W [n, k]^T, built for bandwidth, because at these shapes the
// product is a single read of W. Used plainly by cuda::gemm (ops/linear/gemv_cuda.cu) and,
// with an input stage and an output stage fused in, by the decoder (infer/decode_gemv.cu).
//
// Each warp multiplies a tile of 8 W rows by the staged rows on the tensor cores (see
// gemv_kernel), over its slice of k: k is split over k_splits warps of a block (their
// partial sums added through shared memory) until a warp's slice is at most G groups of
// 128 values (2 or 4, see launch_rows; 4 16-byte loads per lane and group), so for the
// decode projections every load of the whole matrix is issued at once. A block requests
// its first groups, then stages A in shared memory as bf16: a copy of bf16 rows (cp.async),
// or the RMSNorm of fp32 rows (Input::rms_norm: the arithmetic and reduction order of the
// decoder's add_rms_norm kernel, so the staged rows are those bits); the next tile's
// groups are requested before the current one is reduced.
// With constant weights (Args::constant_weights) the first groups are even requested
// before the kernel waits for the one before it (ops/dependent_launch.cuh). Every sum runs
// in a fixed order: the same bits every run.
//
// Output stages: store (alpha acc + beta out, f32 or bf16); add_residual (x += bf16(acc),
// a residual add after a projection); swiglu (each output column j reads W rows j (gate) and
// j + second_row (up) and writes silu(bf16 g) * bf16 u, as the SwiGLU kernel does on a
// stored gate|up). CUDA translation units only; sm_80 and later (mma.sync).
#pragma once

#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "ops/bf16_vector.cuh"
#include "ops/dependent_launch.cuh"
#include "ops/block_reduce.cuh"

#include <cuda_bf16.h>

#include <map>
#include <mutex>
#include <utility>

namespace kiln::cuda::gemv {

using bf16 = __nv_bfloat16;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kVec = vec::kWidth;  // bf16 per 16-byte load
constexpr int kMaxRows = 8;
constexpr int kTileRows = 8;         // W rows per warp tile: the n of the mma
constexpr int kGroupVecs = 16;       // vectors of a W row per k group (128 values): 4 per lane
// k groups a lane loads at once: 2 (8 16-byte loads), or 4 where the registers allow it
// (launch_rows).
constexpr int kGroupsInFlight = 2, kMostGroupsInFlight = 4;
// Staged rows above this many bytes of shared memory do not take the kernel (k of 12K at
// 8 rows fits; the H200 allows 227 KiB per block).
constexpr int64_t kMaxStageBytes = 192 * 1024;

// Elements between staged rows: k rounded up to 64 plus 32, so consecutive rows start 64
// bytes apart modulo 128 and the 8 lanes of a quarter-warp (rows g and g + 1, 4 vectors
// each) read all 32 banks once.
__host__ __device__ constexpr int64_t stage_stride(int64_t k) { return (k + 63) / 64 * 64 + 32; }

enum class Input { bf16_rows, rms_norm };
enum class Output { store, add_residual, swiglu };

struct Args {
  int64_t m = 0, n = 0, k = 0;  // rows, output columns, reduction length (a multiple of 8)
  // Input::bf16_rows: A = a [m, lda] (16-byte aligned rows).
  const bf16* a = nullptr;
  int64_t lda = 0;
  // Input::rms_norm: A = bf16(x * rstd(x) * gain) with x fp32 [m, ldx] and gain fp32 [k].
  const float* x = nullptr;
  int64_t ldx = 0;
  const float* gain = nullptr;
  float eps = 0;
  const bf16* w = nullptr;  // weight rows of ldw elements (16-byte aligned)
  int64_t ldw = 0;
  int64_t second_row = 0;   // Output::swiglu: the up row of column j is j + second_row
  void* out = nullptr;      // store, swiglu: [m, ldo]
  int64_t ldo = 0;
  float alpha = 1, beta = 0;  // store
  float* residual = nullptr;  // add_residual: [m, ldr] fp32
  int64_t ldr = 0;
  // W is never written by the kernels before this one (a model's weights while decoding):
  // its first chunk is then loaded before waiting for them (ops/dependent_launch.cuh).
  bool constant_weights = false;
  // Set by launch(), so the kernel starts its loads without dividing (a 64-bit division is
  // a long dependent chain ahead of the first weight request): the k split (a power of two,
  // as its log2), k groups of 128 values per split, and tiles per block's walk.
  int k_splits = 1, split_shift = 0;
  int32_t k_groups = 0, groups_per_split = 0, block_tiles = 0;
};


__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

constexpr int kStageUnroll = 4;  // fp32 loads per thread and row in flight while normalizing

// 16 bytes global -> shared without a register round trip (cp.async, cached in L2 only:
// the source was just written by the kernel before), and the wait for this thread's copies.
__device__ __forceinline__ void copy_async_16(void* shared, const void* global) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const auto to = static_cast<uint32_t>(__cvta_generic_to_shared(shared));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(to), "l"(global) : "memory");
#else
  __trap();
#endif
}
__device__ __forceinline__ void wait_async_copies() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}

// A [M, k] into shared memory as bf16 (rows m..M-1 zero). scratch: kWarps * M floats.
// Staging is a latency chain in front of the whole product, so every thread issues its
// loads before it uses them: bf16 rows all at once as asynchronous copies, fp32 rows
// kStageUnroll per row at a time, all rows together.
template <int M, Input In>
__device__ __forceinline__ void stage_rows(const Args& p, bf16* as, int64_t stride, float* scratch) {
  const int tid = static_cast<int>(threadIdx.x);
  const int64_t k = p.k;
  if constexpr (In == Input::bf16_rows) {
    // Asynchronous copies straight into shared memory: every one in flight at once without
    // holding registers (8 rows of the down projection are 12 per thread). Measured on the
    // H200 against loads through registers, 4 per thread at a time: 0.749 -> 0.717 ms per
    // 0.6B decode step at batch 1, 1.050 -> 1.008 ms at batch 8.
    const int vecs = static_cast<int>(k / kVec);
#pragma unroll
    for (int r = 0; r < M; ++r)
      for (int v = tid; v < vecs; v += kThreads) {
        const int c = v * kVec;
        if (r < p.m) {
          copy_async_16(as + r * stride + c, p.a + r * p.lda + c);
        } else {
          *reinterpret_cast<uint4*>(as + r * stride + c) = make_uint4(0, 0, 0, 0);
        }
      }
    wait_async_copies();
  } else {
    // As infer/decoder_fused.cu's add_rms_norm_kernel (256 threads), so the staged rows are
    // its bits: per-thread sums over c = tid + 256 i in order (a missing element adds +0,
    // which changes no sum of squares), a warp butterfly, then the 8 warps' sums in order.
    static_assert(kThreads == 256, "the staged RMSNorm repeats a 256-thread reduction");
    // With k <= kThreads * kStageUnroll (the decode shapes' hidden sizes) one pass: the
    // values loaded for the sums are the ones normalized, not loaded again after them.
    const bool one_pass = k <= kThreads * kStageUnroll;
    float ss[M], v[M][kStageUnroll], g[kStageUnroll];
#pragma unroll
    for (int r = 0; r < M; ++r) ss[r] = 0.0f;
    auto load = [&](int64_t c0, bool with_gain) {
#pragma unroll
      for (int u = 0; u < kStageUnroll; ++u) {
        const int64_t c = c0 + u * kThreads;
        if (with_gain) g[u] = c < k ? p.gain[c] : 0.0f;
#pragma unroll
        for (int r = 0; r < M; ++r) v[r][u] = r < p.m && c < k ? p.x[r * p.ldx + c] : 0.0f;
      }
    };
    for (int64_t c0 = tid; c0 < k; c0 += kThreads * kStageUnroll) {
      load(c0, one_pass);
#pragma unroll
      for (int r = 0; r < M; ++r)
#pragma unroll
        for (int u = 0; u < kStageUnroll; ++u) ss[r] += v[r][u] * v[r][u];
    }
    block_sum_rows<kThreads>(ss, scratch);
    float inv[M];
#pragma unroll
    for (int r = 0; r < M; ++r) inv[r] = 1.0f / sqrtf(ss[r] / static_cast<float>(k) + p.eps);
    for (int64_t c0 = tid; c0 < k; c0 += kThreads * kStageUnroll) {
      if (!one_pass) load(c0, true);
#pragma unroll
      for (int u = 0; u < kStageUnroll; ++u)
        if (c0 + u * kThreads < k)
#pragma unroll
          for (int r = 0; r < M; ++r) as[r * stride + c0 + u * kThreads] = __float2bfloat16_rn(v[r][u] * inv[r] * g[u]);
    }
  }
}

// One tensor-core product step: acc[0..1] (row g, columns 2t and 2t + 1 of the warp's tile)
// += A (the staged rows as the mma's rows 0..7; its rows 8..15, whose results acc[2..3]
// stay zero, are zero) times B (the tile's W rows as the mma's columns), over 16 values of
// k: a0/a2 hold row g's values, b0/b1 column g's at the same places of k (see gemv_kernel
// on how k is permuted).
__device__ __forceinline__ void mma_rows(uint32_t a0, uint32_t a2, uint32_t b0, uint32_t b1, float (&acc)[4]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
      : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1));
#else
  __trap();  // the build targets sm_80 and later
#endif
}

// Row r, output column j from its sums: store and add_residual read sum[0]; swiglu reads the
// gate's sum[0] and the up's sum[1]. add_residual adds to x = residual (r, j), loaded ahead.
template <Output Out, typename TOut>
__device__ __forceinline__ void finish(const Args& p, int64_t r, int64_t j, const float (&sum)[2], float x = 0.0f) {
  if constexpr (Out == Output::store) {
    TOut* o = static_cast<TOut*>(p.out) + r * p.ldo + j;
    vec::from_f32(p.beta == 0.0f ? p.alpha * sum[0] : p.alpha * sum[0] + p.beta * vec::to_f32(*o), o);
  } else if constexpr (Out == Output::add_residual) {
    p.residual[r * p.ldr + j] = x + round_bf16(sum[0]);  // the projection stored in bf16, then added
  } else {
    const float g = round_bf16(sum[0]), u = round_bf16(sum[1]);  // gate and up as a stored gate|up
    vec::from_f32(g / (1.0f + expf(-g)) * u, static_cast<bf16*>(p.out) + r * p.ldo + j);
  }
}

// The W row a lane reads for its tile column g (tile of output columns from j0): store and
// add_residual put output column j0 + g there; swiglu interleaves gate and up, column 2i
// the gate row of output j0 + i, column 2i + 1 its up row. Null past the last output.
template <Output Out>
__device__ __forceinline__ const bf16* tile_row(const Args& p, int64_t j0, int g) {
  if constexpr (Out == Output::swiglu) {
    const int64_t j = j0 + g / 2;
    return j < p.n ? p.w + (j + (g & 1) * p.second_row) * p.ldw : nullptr;
  } else {
    return j0 + g < p.n ? p.w + (j0 + g) * p.ldw : nullptr;
  }
}

// A lane's W vectors of G k groups from group `first` of its slice: vector t + 4 i of each
// group (zero past the slice end or without a row).
template <int G>
__device__ __forceinline__ void load_groups(const bf16* row, int64_t first, int t, int64_t v_end,
                                            uint4 (&raw)[G][4]) {
#pragma unroll
  for (int gi = 0; gi < G; ++gi)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t v = (first + gi) * kGroupVecs + t + 4 * i;
      raw[gi][i] = row != nullptr && v < v_end ? __ldg(reinterpret_cast<const uint4*>(row + v * kVec))
                                               : make_uint4(0, 0, 0, 0);
    }
}

// Each warp computes a tile of 8 W rows (the mma's n) against the M <= 8 staged rows over
// its k slice with bf16 tensor-core products (mma.sync m16n8k16, fp32 accumulation). k is
// taken in groups of 128 values (16 vectors): lane (g, t) = (lane / 4, lane % 4) loads
// vectors t, t + 4, t + 8, t + 12 of a group of its tile row g, 16 bytes at a time, and
// reads the staged row g at the same vectors. The mma sums over k in its own fixed
// pattern, so which lane holds which k does not matter as long as A and B agree: the
// loads stay whole 16-byte vectors instead of the fragment layout's 4-byte pairs. Rows
// past M and tile columns past the last output are zero. The k slices of a tile's warps
// add up through shared memory in split order: the same bits every run.
template <int M, int G, Input In, Output Out, typename TOut>
__global__ void __launch_bounds__(kThreads, 2) gemv_kernel(const Args p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int64_t stride = stage_stride(p.k);
  bf16* as = reinterpret_cast<bf16*>(smem);                                        // [M, stride]
  float* partial = reinterpret_cast<float*>(smem + sizeof(bf16) * M * stride);     // [kWarps, 8, 8]
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int splits = p.k_splits, groups = kWarps >> p.split_shift;
  const int split = warp & (splits - 1), group = warp >> p.split_shift;
  const int64_t vecs = p.k / kVec, k_groups = p.k_groups, per_split = p.groups_per_split;
  const int64_t g_begin = split * per_split, g_end = min(k_groups, g_begin + per_split);
  const int64_t v_end = min(vecs, g_end * kGroupVecs);
  constexpr int64_t kColumns = Out == Output::swiglu ? kTileRows / 2 : kTileRows;  // outputs per tile
  auto first_column = [&](int64_t block_tile) { return (block_tile * groups + group) * kColumns; };
  const int64_t block_tiles = p.block_tiles;

  // The first groups of W are requested before the rows are staged: the weights' latency
  // hides the staging's, and with the split chosen so every load of the matrix is in
  // flight at once.
  uint4 raw[G][4];
  int64_t tile = blockIdx.x;
  allow_dependents();
  if (!p.constant_weights) wait_for_producer();
  if (tile < block_tiles) load_groups(tile_row<Out>(p, first_column(tile), g), g_begin, t, v_end, raw);
  if (p.constant_weights) wait_for_producer();  // A (and the residual) come from the kernels before
  // add_residual: the residual values lane (g, t) adds to (row g, columns j0 + 2t and
  // j0 + 2t + 1 of a tile), requested before the staging and the products, not after them.
  float resid[2] = {0.0f, 0.0f};
  auto load_residual = [&](int64_t block_tile) {
    if constexpr (Out == Output::add_residual) {
      const int64_t j = first_column(block_tile) + 2 * t;
#pragma unroll
      for (int c = 0; c < 2; ++c)
        resid[c] = split == 0 && g < p.m && j + c < p.n ? p.residual[g * p.ldr + j + c] : 0.0f;
    }
  };
  if (tile < block_tiles) load_residual(tile);
  stage_rows<M, In>(p, as, stride, partial);
  __syncthreads();

  const bf16* a_row = as + (g < M ? g : 0) * stride;
  for (; tile < block_tiles; tile += gridDim.x) {
    const int64_t j0 = first_column(tile);
    const bf16* w_row = tile_row<Out>(p, j0, g);
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int64_t first = g_begin; first < g_end; first += G) {
      if (first != g_begin) load_groups(w_row, first, t, v_end, raw);
#pragma unroll
      for (int gi = 0; gi < G; ++gi)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int64_t v = (first + gi) * kGroupVecs + t + 4 * i;
          const uint4 a = g < M && v < v_end ? *reinterpret_cast<const uint4*>(a_row + v * kVec)
                                             : make_uint4(0, 0, 0, 0);
          mma_rows(a.x, a.y, raw[gi][i].x, raw[gi][i].y, acc);
          mma_rows(a.z, a.w, raw[gi][i].z, raw[gi][i].w, acc);
        }
    }
    // The next tile's first groups are requested before this one is reduced and written.
    if (tile + gridDim.x < block_tiles)
      load_groups(tile_row<Out>(p, first_column(tile + gridDim.x), g), g_begin, t, v_end, raw);

    // Lane (g, t) holds row g, tile columns 2t and 2t + 1: outputs j0 + 2t and j0 + 2t + 1,
    // or for swiglu the gate and up of output j0 + t.
    float sum[2] = {acc[0], acc[1]};
    if (splits > 1) {
      float* mine = partial + (warp * kTileRows + g) * kTileRows + 2 * t;
      mine[0] = acc[0], mine[1] = acc[1];
      __syncthreads();
      if (split == 0) {
        sum[0] = sum[1] = 0.0f;
        for (int s = 0; s < splits; ++s) {
          const float* theirs = partial + ((warp + s) * kTileRows + g) * kTileRows + 2 * t;
          sum[0] += theirs[0], sum[1] += theirs[1];
        }
      }
    }
    if (split == 0 && g < p.m) {
      if constexpr (Out == Output::swiglu) {
        if (j0 + t < p.n) finish<Out, TOut>(p, g, j0 + t, sum);
      } else {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const float one[2] = {sum[c], 0.0f};
          if (j0 + 2 * t + c < p.n) finish<Out, TOut>(p, g, j0 + 2 * t + c, one, resid[c]);
        }
      }
    }
    if (tile + gridDim.x < block_tiles) load_residual(tile + gridDim.x);
    if (splits > 1) __syncthreads();  // partial is rewritten by the next tile
  }
}

// Blocks of `kernel` resident per SM with `smem` bytes of shared memory, asked once per
// (kernel, smem) (also raising the kernel's dynamic shared memory limit to kMaxStageBytes+).
template <typename Kernel>
int resident_blocks(Kernel kernel, size_t smem) {
  static std::mutex mutex;
  static std::map<std::pair<const void*, size_t>, int> known;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_pair(reinterpret_cast<const void*>(kernel), smem);
  if (auto it = known.find(key); it != known.end()) return it->second;
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(kMaxStageBytes + 4096)),
        "gemv", "cudaFuncSetAttribute");
  int blocks = 0;
  check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kThreads, smem), "gemv",
        "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  known.emplace(key, blocks);
  return blocks;
}

// Shared memory of one block: the staged rows and the split partials.
template <int M>
size_t stage_bytes(int64_t k) {
  return sizeof(bf16) * M * static_cast<size_t>(stage_stride(k)) + sizeof(float) * kWarps * kTileRows * kTileRows;
}

// True when the kernel takes the problem (shapes, alignment, shared memory).
inline bool fits(const Args& p, Input in) {
  if (p.m < 1 || p.m > kMaxRows || p.n < 1 || p.k < kVec || p.k % kVec != 0 || p.ldw % kVec != 0) return false;
  if (!vec::aligned16(p.w)) return false;
  if (in == Input::bf16_rows && (p.lda % kVec != 0 || !vec::aligned16(p.a))) return false;
  return stage_bytes<kMaxRows>(p.k) <= static_cast<size_t>(kMaxStageBytes);
}

// Enqueues the kernel on the stream. The k split is the smallest that leaves each warp at
// most G k groups of its tile (so every load is issued up front), at most one split per warp.
template <int M, int G, Input In, Output Out, typename TOut>
void launch_split(Args p, cudaStream_t stream) {
  constexpr int64_t kColumns = Out == Output::swiglu ? kTileRows / 2 : kTileRows;
  const int64_t k_groups = (p.k / kVec + kGroupVecs - 1) / kGroupVecs;
  int splits = 1;
  while (splits < kWarps && (k_groups + splits - 1) / splits > G) splits *= 2;
  const int64_t tiles = (p.n + kColumns - 1) / kColumns, per_block = kWarps / splits;
  const int64_t blocks = (tiles + per_block - 1) / per_block;
  p.k_splits = splits;
  p.split_shift = __builtin_ctz(static_cast<unsigned>(splits));
  p.k_groups = static_cast<int32_t>(k_groups);
  p.groups_per_split = static_cast<int32_t>((k_groups + splits - 1) / splits);
  p.block_tiles = static_cast<int32_t>(blocks);
  const size_t smem = stage_bytes<M>(p.k);
  auto kernel = gemv_kernel<M, G, In, Out, TOut>;
  const int64_t resident = static_cast<int64_t>(resident_blocks(kernel, smem)) * sm_count();
  if (resident < 1) fail("gemv", "no block of {} bytes of shared memory fits an SM", smem);
  const auto grid = static_cast<unsigned>(std::min(blocks, resident));
  launch_dependent_on(stream, "gemv", "gemv_kernel", kernel, dim3(grid), dim3(kThreads), smem, p);
}

template <int M, Input In, Output Out, typename TOut>
void launch_rows(const Args& p, cudaStream_t stream) {
  const int64_t k_groups = (p.k / kVec + kGroupVecs - 1) / kGroupVecs;
  // Four groups in flight per lane where the registers allow: the copied rows' long k (the
  // o and down projections), and the normalized rows up to 4 of them (q|k|v, gate|up and the
  // LM head at k = 1024: half the blocks, so one wave holds the matrix). Measured on the
  // H200: 0.848 -> 0.811 ms per 0.6B decode step at batch 1; the o projection (k = 2048)
  // on four groups was slower.
  if constexpr (In == Input::bf16_rows) {
    if (k_groups > kWarps * kGroupsInFlight) return launch_split<M, kMostGroupsInFlight, In, Out, TOut>(p, stream);
  } else if constexpr (M <= 4) {
    if (k_groups > 2 * kGroupsInFlight) return launch_split<M, kMostGroupsInFlight, In, Out, TOut>(p, stream);
  }
  launch_split<M, kGroupsInFlight, In, Out, TOut>(p, stream);
}

// Picks the row-count instantiation (1, 2, 4 or 8 rows; rows past m are zero). The
// products cost the same at any row count; the staging does not. On `stream`; the
// process-wide one by default (the decoder's projections).
template <Input In, Output Out, typename TOut>
void launch(const Args& p, cudaStream_t stream) {
  if (p.m <= 1) return launch_rows<1, In, Out, TOut>(p, stream);
  if (p.m <= 2) return launch_rows<2, In, Out, TOut>(p, stream);
  if (p.m <= 4) return launch_rows<4, In, Out, TOut>(p, stream);
  launch_rows<8, In, Out, TOut>(p, stream);
}

}  // namespace kiln::cuda::gemv

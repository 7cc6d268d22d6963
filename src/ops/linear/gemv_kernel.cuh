// The skinny-product kernel: out [m, n] from A [m, k] (m <= 8 rows, the tokens of a decode
// step) times a bf16 weight W [n, k]^T, built for bandwidth, because at these shapes the
// product is a single read of W. Used plainly by cuda::gemm (ops/linear/gemv_cuda.cu) and,
// with an input stage and an output stage fused in, by the decoder (infer/decode_gemv.cu).
//
// Each warp takes C columns of W (4, or 2 gate|up pairs) over its slice of k, in chunks of
// kChunk 16-byte vectors per W row (2 per lane, all in flight together). k is split over
// k_splits warps of a block (their partial sums added through shared memory) until one
// chunk covers a warp's slice, so for the decode shapes every load of the whole matrix is
// issued at once. A block requests its first chunk, then stages A in shared memory as bf16:
// a copy of bf16 rows, or the RMSNorm of fp32 rows (Input::rms_norm: the arithmetic and
// reduction order of the decoder's add_rms_norm kernel, so the staged rows are those
// bits); the next tile's chunk is requested before the current one is reduced. With
// constant weights (Args::constant_weights) the first chunk is even requested before the
// kernel waits for the one before it (ops/dependent_launch.cuh). Every sum runs in a fixed
// order: the same bits every run.
//
// Output stages: store (alpha acc + beta out, f32 or bf16); add_residual (x += bf16(acc),
// a residual add after a projection); swiglu (each output column j reads W rows j (gate) and
// j + second_row (up) and writes silu(bf16 g) * bf16 u, as the SwiGLU kernel does on a
// stored gate|up). CUDA translation units only.
#pragma once

#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "ops/bf16_vector.cuh"
#include "ops/dependent_launch.cuh"
#include "ops/warp_reduce.cuh"

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
// Vectors of a W row a warp loads at once (2 per lane): a warp's k slice is one chunk
// whenever k <= kChunk * 8 * kWarps (4096).
constexpr int kChunk = 64;
// Staged rows above this many bytes of shared memory do not take the kernel (k of 12K at
// 8 rows fits; the H200 allows 227 KiB per block).
constexpr int64_t kMaxStageBytes = 192 * 1024;

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
  int k_splits = 1;  // set by launch()
};


__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

constexpr int kStageUnroll = 4;  // loads per thread in flight while staging

// A [M, k] into shared memory as bf16 (rows m..M-1 zero). scratch: kWarps * M floats.
// Every thread issues its loads (kStageUnroll per row at a time, all rows together) before
// it uses them: staging is a latency chain in front of the whole product.
template <int M, Input In>
__device__ __forceinline__ void stage_rows(const Args& p, bf16* as, float* scratch) {
  const int tid = static_cast<int>(threadIdx.x);
  const int64_t k = p.k;
  if constexpr (In == Input::bf16_rows) {
    const int64_t vecs = k / kVec, total = M * vecs;
    for (int64_t i0 = tid; i0 < total; i0 += kThreads * kStageUnroll) {
      uint4 val[kStageUnroll];
#pragma unroll
      for (int u = 0; u < kStageUnroll; ++u) {
        const int64_t i = i0 + u * kThreads, r = i / vecs;
        val[u] = i < total && r < p.m ? *reinterpret_cast<const uint4*>(p.a + r * p.lda + (i - r * vecs) * kVec)
                                      : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < kStageUnroll; ++u)
        if (i0 + u * kThreads < total) reinterpret_cast<uint4*>(as)[i0 + u * kThreads] = val[u];
    }
  } else {
    // As infer/decoder_fused.cu's add_rms_norm_kernel (256 threads), so the staged rows are
    // its bits: per-thread sums over c = tid + 256 i in order (a missing element adds +0,
    // which changes no sum of squares), a warp butterfly, then the 8 warps' sums in order.
    static_assert(kThreads == 256, "the staged RMSNorm repeats a 256-thread reduction");
    float ss[M];
#pragma unroll
    for (int r = 0; r < M; ++r) ss[r] = 0.0f;
    for (int64_t c0 = tid; c0 < k; c0 += kThreads * kStageUnroll) {
      float v[M][kStageUnroll];
#pragma unroll
      for (int r = 0; r < M; ++r)
#pragma unroll
        for (int u = 0; u < kStageUnroll; ++u) {
          const int64_t c = c0 + u * kThreads;
          v[r][u] = r < p.m && c < k ? p.x[r * p.ldx + c] : 0.0f;
        }
#pragma unroll
      for (int r = 0; r < M; ++r)
#pragma unroll
        for (int u = 0; u < kStageUnroll; ++u) ss[r] += v[r][u] * v[r][u];
    }
#pragma unroll
    for (int r = 0; r < M; ++r) ss[r] = warp_sum(ss[r]);
    if ((tid & 31) == 0)
#pragma unroll
      for (int r = 0; r < M; ++r) scratch[r * kWarps + (tid >> 5)] = ss[r];
    __syncthreads();
    float inv[M];
#pragma unroll
    for (int r = 0; r < M; ++r) {
      float total = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) total += scratch[r * kWarps + w];
      inv[r] = 1.0f / sqrtf(total / static_cast<float>(k) + p.eps);
    }
    for (int64_t c0 = tid; c0 < k; c0 += kThreads * kStageUnroll) {
      float v[M][kStageUnroll], g[kStageUnroll];
#pragma unroll
      for (int u = 0; u < kStageUnroll; ++u) {
        const int64_t c = c0 + u * kThreads;
        g[u] = c < k ? p.gain[c] : 0.0f;
#pragma unroll
        for (int r = 0; r < M; ++r) v[r][u] = r < p.m && c < k ? p.x[r * p.ldx + c] : 0.0f;
      }
#pragma unroll
      for (int u = 0; u < kStageUnroll; ++u)
        if (c0 + u * kThreads < k)
#pragma unroll
          for (int r = 0; r < M; ++r) as[r * k + c0 + u * kThreads] = __float2bfloat16_rn(v[r][u] * inv[r] * g[u]);
    }
  }
}

// Row r, column j of the output from its sums (one per W row the column reads).
template <Output Out, typename TOut, int R>
__device__ __forceinline__ void finish(const Args& p, int64_t r, int64_t j, const float (&sum)[R]) {
  if constexpr (Out == Output::store) {
    TOut* o = static_cast<TOut*>(p.out) + r * p.ldo + j;
    vec::from_f32(p.beta == 0.0f ? p.alpha * sum[0] : p.alpha * sum[0] + p.beta * vec::to_f32(*o), o);
  } else if constexpr (Out == Output::add_residual) {
    p.residual[r * p.ldr + j] += round_bf16(sum[0]);  // the projection stored in bf16, then added
  } else {
    const float g = round_bf16(sum[0]), u = round_bf16(sum[1]);  // gate and up as a stored gate|up
    vec::from_f32(g / (1.0f + expf(-g)) * u, static_cast<bf16*>(p.out) + r * p.ldo + j);
  }
}

// A warp's share of W for one chunk of its k slice: U vectors of each of its Q rows per lane
// (zero past the slice or the last column).
template <int U, int Q, int C, int R>
__device__ __forceinline__ void load_chunk(const Args& p, int64_t j0, int64_t v, int64_t v_end,
                                           uint4 (&raw)[U][Q]) {
#pragma unroll
  for (int c = 0; c < C; ++c)
#pragma unroll
    for (int s = 0; s < R; ++s) {
      const bool live = j0 + c < p.n;
      const bf16* row = p.w + (live ? j0 + c + s * p.second_row : 0) * p.ldw;
#pragma unroll
      for (int u = 0; u < U; ++u)
        raw[u][c * R + s] = live && v + 32 * u < v_end
                                ? __ldg(reinterpret_cast<const uint4*>(row + (v + 32 * u) * kVec))
                                : make_uint4(0, 0, 0, 0);
    }
}

template <int M, Input In, Output Out, typename TOut>
__global__ void __launch_bounds__(kThreads, 2) gemv_kernel(const Args p) {
  constexpr int R = Out == Output::swiglu ? 2 : 1;  // W rows per output column
  constexpr int C = 4 / R;                          // output columns per warp
  constexpr int Q = C * R;                          // W rows per warp
  constexpr int U = kChunk / 32;                    // 16-byte loads per lane and W row in flight
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* as = reinterpret_cast<bf16*>(smem);                                       // [M, k]
  float* partial = reinterpret_cast<float*>(smem + sizeof(bf16) * M * p.k);       // [kWarps, M, Q]
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
  const int splits = p.k_splits, groups = kWarps / splits;
  const int split = warp % splits, group = warp / splits;
  const int64_t vecs = p.k / kVec, per_split = (vecs + splits - 1) / splits;
  const int64_t v_begin = split * per_split, v_end = min(vecs, v_begin + per_split);
  const int64_t tiles = (p.n + groups * C - 1) / (groups * C);
  auto first_column = [&](int64_t tile) { return (tile * groups + group) * C; };

  // The first chunk of W is requested before the rows are staged: the weights' latency
  // hides the staging's, and with one chunk per warp (k_splits chosen so) the whole matrix
  // is in flight at once.
  uint4 raw[U][Q];
  int64_t tile = blockIdx.x;
  allow_dependents();
  if (!p.constant_weights) wait_for_producer();
  if (tile < tiles) load_chunk<U, Q, C, R>(p, first_column(tile), v_begin + lane, v_end, raw);
  if (p.constant_weights) wait_for_producer();  // A (and the residual) come from the kernels before
  stage_rows<M, In>(p, as, partial);
  __syncthreads();

  for (; tile < tiles; tile += gridDim.x) {
    const int64_t j0 = first_column(tile);
    float acc[M][Q];
#pragma unroll
    for (int r = 0; r < M; ++r)
#pragma unroll
      for (int q = 0; q < Q; ++q) acc[r][q] = 0.0f;
    for (int64_t v = v_begin + lane; v < v_end; v += kChunk) {
      if (v != v_begin + lane) load_chunk<U, Q, C, R>(p, j0, v, v_end, raw);
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (v + 32 * u >= v_end) break;
        float wf[Q][kVec];
#pragma unroll
        for (int q = 0; q < Q; ++q) {
          const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw[u][q]);
#pragma unroll
          for (int i = 0; i < kVec / 2; ++i) {
            const float2 f = __bfloat1622float2(h[i]);
            wf[q][2 * i] = f.x, wf[q][2 * i + 1] = f.y;
          }
        }
#pragma unroll
        for (int r = 0; r < M; ++r) {
          float a[kVec];
          vec::load8(as + r * p.k + (v + 32 * u) * kVec, a);
#pragma unroll
          for (int q = 0; q < Q; ++q)
#pragma unroll
            for (int i = 0; i < kVec; ++i) acc[r][q] = fmaf(a[i], wf[q][i], acc[r][q]);
        }
      }
    }
    // The next tile's first chunk is requested before this one is reduced and written.
    if (tile + gridDim.x < tiles) load_chunk<U, Q, C, R>(p, first_column(tile + gridDim.x), v_begin + lane, v_end, raw);
#pragma unroll
    for (int r = 0; r < M; ++r)
#pragma unroll
      for (int q = 0; q < Q; ++q) acc[r][q] = warp_sum(acc[r][q]);

    // Lane l writes output (r, c) = (l / C, l % C): the writes (and the residual's reads)
    // of a tile go out together, not one after another from one lane.
    const int r_out = lane / C, c_out = lane % C;
    const bool writes = lane < M * C && r_out < p.m && j0 + c_out < p.n;
    if (splits == 1) {
      float sum[R] = {};
#pragma unroll
      for (int r = 0; r < M; ++r)
#pragma unroll
        for (int c = 0; c < C; ++c)
          if (r * C + c == lane)
#pragma unroll
            for (int s = 0; s < R; ++s) sum[s] = acc[r][c * R + s];
      if (writes) finish<Out, TOut, R>(p, r_out, j0 + c_out, sum);
      continue;
    }
    // The k-splits of a column group add up in split order.
    if (lane == 0)
#pragma unroll
      for (int r = 0; r < M; ++r)
#pragma unroll
        for (int q = 0; q < Q; ++q) partial[(warp * M + r) * Q + q] = acc[r][q];
    __syncthreads();
    if (split == 0 && writes) {
      float sum[R] = {};
      for (int s = 0; s < splits; ++s)
#pragma unroll
        for (int t = 0; t < R; ++t) sum[t] += partial[((warp + s) * M + r_out) * Q + c_out * R + t];
      finish<Out, TOut, R>(p, r_out, j0 + c_out, sum);
    }
    __syncthreads();  // partial is rewritten by the next tile
  }
}

inline int sm_count() {
  static const int count = [] {
    int device = 0, n = 0;
    check(cudaGetDevice(&device), "gemv", "cudaGetDevice");
    check(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device), "gemv", "cudaDeviceGetAttribute");
    return n;
  }();
  return count;
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
size_t stage_bytes(int64_t k, int q) {
  return sizeof(bf16) * M * static_cast<size_t>(k) + sizeof(float) * kWarps * M * q;
}

// True when the kernel takes the problem (shapes, alignment, shared memory).
inline bool fits(const Args& p, Input in) {
  if (p.m < 1 || p.m > kMaxRows || p.n < 1 || p.k < kVec || p.k % kVec != 0 || p.ldw % kVec != 0) return false;
  if (!vec::aligned16(p.w)) return false;
  if (in == Input::bf16_rows && (p.lda % kVec != 0 || !vec::aligned16(p.a))) return false;
  return stage_bytes<kMaxRows>(p.k, 4) <= static_cast<size_t>(kMaxStageBytes);
}

// Enqueues the kernel on the stream. The k split is the smallest that leaves each warp one
// chunk of its W rows (so every load is issued up front), at most one split per warp.
template <int M, Input In, Output Out, typename TOut>
void launch_rows(Args p) {
  constexpr int R = Out == Output::swiglu ? 2 : 1, C = 4 / R;
  const int64_t vecs = p.k / kVec;
  int splits = 1;
  while (splits < kWarps && (vecs + splits - 1) / splits > kChunk) splits *= 2;
  p.k_splits = splits;
  const int64_t tiles = (p.n + (kWarps / splits) * C - 1) / ((kWarps / splits) * C);
  const size_t smem = stage_bytes<M>(p.k, C * R);
  auto kernel = gemv_kernel<M, In, Out, TOut>;
  const int64_t resident = static_cast<int64_t>(resident_blocks(kernel, smem)) * sm_count();
  if (resident < 1) fail("gemv", "no block of {} bytes of shared memory fits an SM", smem);
  const auto grid = static_cast<unsigned>(std::min(tiles, resident));
  launch_dependent("gemv", "gemv_kernel", kernel, dim3(grid), dim3(kThreads), smem, p);
}

// Picks the row-count instantiation (1, 2, 4 or 8 rows; rows past m are zero).
template <Input In, Output Out, typename TOut>
void launch(const Args& p) {
  if (p.m <= 1) return launch_rows<1, In, Out, TOut>(p);
  if (p.m <= 2) return launch_rows<2, In, Out, TOut>(p);
  if (p.m <= 4) return launch_rows<4, In, Out, TOut>(p);
  launch_rows<8, In, Out, TOut>(p);
}

}  // namespace kiln::cuda::gemv

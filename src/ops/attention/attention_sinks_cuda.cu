// The attention sinks' correction on the GPU (attention_sinks_cuda.h).
//
// Forward: one warp per (query row, head): w = sigmoid(lse - s_h), O' = w O, lse' =
// logaddexp(lse, s_h), in place (every lane reads lse before lane 0 rewrites it).
// Backward: block b owns a contiguous run of query rows; its warps take the run's (row, head)
// pairs in turn, each adding exp(s_h - lse') (dO . O') into its own per-head slot in shared
// memory; the warps' slots are added in warp order into the block's row of partials in the
// context's scratch (core/context_scratch.h), and a second kernel adds the blocks' rows in a
// fixed order (ops/column_sums.cuh) into dsinks. Same inputs, same bits; no atomics, no
// allocation after the first call, no host synchronization.
#include "ops/attention/attention_sinks_cuda.h"

#include "core/context_scratch.h"
#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "core/error.h"
#include "ops/bf16_vector.cuh"
#include "ops/block_reduce.cuh"
#include "ops/column_sums.cuh"

#include <cuda_bf16.h>

#include <algorithm>

namespace kiln::cuda {

namespace {

using bf16 = __nv_bfloat16;
using vec::from_f32;
using vec::to_f32;

constexpr const char* kOp = "attention_sinks";
constexpr int kWarps = 8;
constexpr int kThreads = kWarps * kWarpSize;
constexpr int64_t kMaxPartialRows = 512;              // blocks of the backward at most
constexpr int64_t kScratchFloats = int64_t{1} << 18;  // partials [blocks, q_heads]
constexpr int64_t kMaxHeads = 1024;                   // kWarps x heads floats of shared memory
constexpr ScratchKind kPartials{"attention_sinks_backward", kScratchFloats * sizeof(float)};
constexpr int kSumSlices = 16;

// Where row i, head h's log-sum-exp lives (see SinkArgs::lse_seq).
__device__ __forceinline__ int64_t lse_index(const SinkArgs& a, int64_t i, int64_t h) {
  if (a.lse_seq <= 0) return i * a.q_heads + h;
  return ((i / a.lse_seq) * a.q_heads + h) * a.lse_seq + i % a.lse_seq;
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    forward_kernel(SinkArgs a, T* __restrict__ out, float* __restrict__ lse, const float* __restrict__ sinks) {
  const int64_t warp = blockIdx.x * static_cast<int64_t>(kWarps) + threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  if (warp >= a.tokens * a.q_heads) return;
  const int64_t i = warp / a.q_heads, h = warp % a.q_heads;
  float* const l = lse + lse_index(a, i, h);
  const float x = *l, s = sinks[h];
  // Both stable for either sign of x - s (expf overflows to inf only where w is 0).
  const float w = 1.0f / (1.0f + expf(s - x));
  const float merged = fmaxf(x, s) + log1pf(expf(-fabsf(x - s)));
  T* const o = out + warp * a.head_dim;
  for (int64_t c = lane; c < a.head_dim; c += kWarpSize) from_f32(w * to_f32(o[c]), o + c);
  __syncwarp();
  if (lane == 0) *l = merged;
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    partials_kernel(SinkArgs a, const T* __restrict__ out, const float* __restrict__ lse, const T* __restrict__ dout,
                    const float* __restrict__ sinks, int64_t rows_per_block, float* __restrict__ partials) {
  extern __shared__ float slots[];  // [kWarps][q_heads]
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  for (int64_t j = threadIdx.x; j < kWarps * a.q_heads; j += kThreads) slots[j] = 0.0f;
  __syncthreads();
  const int64_t first = blockIdx.x * rows_per_block * a.q_heads;
  const int64_t last = min(a.tokens, (blockIdx.x + 1) * rows_per_block) * a.q_heads;
  for (int64_t p = first + warp; p < last; p += kWarps) {
    const int64_t i = p / a.q_heads, h = p % a.q_heads;
    const T* const o = out + p * a.head_dim;
    const T* const g = dout + p * a.head_dim;
    float dot = 0.0f;
    for (int64_t c = lane; c < a.head_dim; c += kWarpSize) dot += to_f32(g[c]) * to_f32(o[c]);
    dot = warp_sum(dot);
    if (lane == 0) slots[warp * a.q_heads + h] += expf(sinks[h] - lse[lse_index(a, i, h)]) * dot;
  }
  __syncthreads();
  for (int64_t h = threadIdx.x; h < a.q_heads; h += kThreads) {
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) total += slots[w * a.q_heads + h];
    partials[blockIdx.x * a.q_heads + h] = total;
  }
}

// dsinks[h] -= the blocks' partials of head h, added in a fixed order.
__global__ void __launch_bounds__(kColumnSumCols* kSumSlices)
    column_sum_kernel(const float* __restrict__ partials, int64_t blocks, int64_t heads, float* __restrict__ dsinks) {
  const int64_t h = blockIdx.x * static_cast<int64_t>(kColumnSumCols) + threadIdx.x;
  float total;
  if (column_total<kSumSlices>(partials, blocks, heads, h, total)) dsinks[h] -= total;
}

}  // namespace

void attention_sinks_forward(const ExecContext& ctx, const SinkArgs& a, void* out, float* lse, const float* sinks) {
  const int64_t pairs = a.tokens * a.q_heads;
  if (pairs == 0) return;
  const unsigned blocks = blocks_for(pairs, kWarps);
  if (a.bf16)
    forward_kernel<bf16><<<blocks, kThreads, 0, stream(ctx)>>>(a, static_cast<bf16*>(out), lse, sinks);
  else
    forward_kernel<float><<<blocks, kThreads, 0, stream(ctx)>>>(a, static_cast<float*>(out), lse, sinks);
  check_launch(kOp, "forward_kernel");
}

void attention_sinks_backward(const ExecContext& ctx, const SinkArgs& a, const void* out, const float* lse,
                              const void* dout, const float* sinks, float* dsinks) {
  if (a.tokens == 0 || a.q_heads == 0) return;
  KILN_CHECK(a.q_heads <= kMaxHeads, kOp, "{} query heads exceed the sinks' gradient kernel's {}", a.q_heads,
             kMaxHeads);
  float* const partials = context_scratch_as<float>(ctx, kPartials);
  // As many blocks as the scratch holds (at most kMaxPartialRows), the rows spread evenly.
  int64_t blocks = std::min({a.tokens, kMaxPartialRows, kScratchFloats / a.q_heads});
  const int64_t rows_per_block = (a.tokens + blocks - 1) / blocks;
  blocks = (a.tokens + rows_per_block - 1) / rows_per_block;
  const size_t shared = static_cast<size_t>(kWarps * a.q_heads) * sizeof(float);
  if (a.bf16)
    partials_kernel<bf16><<<static_cast<unsigned>(blocks), kThreads, shared, stream(ctx)>>>(
        a, static_cast<const bf16*>(out), lse, static_cast<const bf16*>(dout), sinks, rows_per_block, partials);
  else
    partials_kernel<float><<<static_cast<unsigned>(blocks), kThreads, shared, stream(ctx)>>>(
        a, static_cast<const float*>(out), lse, static_cast<const float*>(dout), sinks, rows_per_block, partials);
  check_launch(kOp, "partials_kernel");
  column_sum_kernel<<<blocks_for(a.q_heads, kColumnSumCols), dim3(kColumnSumCols, kSumSlices), 0, stream(ctx)>>>(
      partials, blocks, a.q_heads, dsinks);
  check_launch(kOp, "column_sum_kernel");
}

}  // namespace kiln::cuda

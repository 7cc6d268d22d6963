#include "infer/decoder_cuda.h"

#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "ops/dependent_launch.cuh"

#include <cfloat>

namespace kiln::cuda {

namespace {

// One block per row, every load of the row issued in a few batches: at decode batch sizes
// this kernel is one or a few blocks reading a whole row each, so its time is the number of
// dependent rounds of loads, not bandwidth. (The first version, 512 threads looping over
// single floats, took tens of microseconds of a 0.8 ms decode step.)
constexpr int kArgmaxThreads = 1024;
constexpr int kArgmaxUnroll = 8;  // 16-byte loads in flight per thread

// Keeps the larger value; on equal values (and for NaN, which never compares larger) the
// lower index, so the result does not depend on the reduction's order.
__device__ __forceinline__ void better(float& v, int32_t& i, float ov, int32_t oi) {
  if (ov > v || (ov == v && oi < i)) v = ov, i = oi;
}

__global__ void __launch_bounds__(kArgmaxThreads)
    argmax_rows_kernel(const float* __restrict__ logits, int64_t vocab, int32_t* __restrict__ out) {
  allow_dependents();
  wait_for_producer();  // the logits come from the LM head before
  const float* row = logits + blockIdx.x * vocab;
  float v = -FLT_MAX;
  int32_t idx = INT32_MAX;
  const auto tid = static_cast<int64_t>(threadIdx.x);
  if (vocab % 4 == 0) {  // rows of whole, aligned float4s
    const auto* row4 = reinterpret_cast<const float4*>(row);
    const int64_t n4 = vocab / 4;
    for (int64_t j0 = tid; j0 < n4; j0 += kArgmaxThreads * kArgmaxUnroll) {
      float4 x[kArgmaxUnroll];
#pragma unroll
      for (int u = 0; u < kArgmaxUnroll; ++u) {
        const int64_t j = j0 + u * kArgmaxThreads;
        if (j < n4) x[u] = row4[j];
      }
#pragma unroll
      for (int u = 0; u < kArgmaxUnroll; ++u) {
        const int64_t j = j0 + u * kArgmaxThreads;
        if (j >= n4) continue;
        const auto c = static_cast<int32_t>(4 * j);
        better(v, idx, x[u].x, c), better(v, idx, x[u].y, c + 1), better(v, idx, x[u].z, c + 2);
        better(v, idx, x[u].w, c + 3);
      }
    }
  } else {
    for (int64_t j = tid; j < vocab; j += kArgmaxThreads) better(v, idx, row[j], static_cast<int32_t>(j));
  }
  for (int offset = 16; offset > 0; offset >>= 1)
    better(v, idx, __shfl_xor_sync(0xffffffffu, v, offset), __shfl_xor_sync(0xffffffffu, idx, offset));
  __shared__ float values[kArgmaxThreads / 32];
  __shared__ int32_t indices[kArgmaxThreads / 32];
  const int warp = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
  if (lane == 0) values[warp] = v, indices[warp] = idx;
  __syncthreads();
  if (warp != 0) return;
  v = values[lane], idx = indices[lane];
  for (int offset = 16; offset > 0; offset >>= 1)
    better(v, idx, __shfl_xor_sync(0xffffffffu, v, offset), __shfl_xor_sync(0xffffffffu, idx, offset));
  // A row of NaN or -inf only: the first index, as std::max_element would give.
  if (lane == 0) out[blockIdx.x] = idx == INT32_MAX ? 0 : idx;
}

// One block of at least `rows` threads.
__global__ void record_greedy_ids_kernel(const int32_t* __restrict__ ids, int64_t rows, int32_t* __restrict__ history,
                                         int32_t* __restrict__ counter, bool advance, int32_t* __restrict__ tokens,
                                         int32_t* __restrict__ positions) {
  allow_dependents();
  wait_for_producer();  // the ids come from the argmax before
  const int64_t step = *counter;
  const auto i = static_cast<int64_t>(threadIdx.x);
  if (i < rows) {
    const int32_t id = ids[i];
    history[step * rows + i] = id;
    if (advance) tokens[i] = id, positions[i] += 1;
  }
  __syncthreads();  // every thread has read the counter
  if (threadIdx.x == 0) *counter = advance ? static_cast<int32_t>(step + 1) : 0;
}

}  // namespace

void record_greedy_ids(const ExecContext& ctx, const int32_t* ids, int64_t rows, int32_t* history, int32_t* counter, bool advance,
                       int32_t* tokens, int32_t* positions) {
  const auto threads = static_cast<unsigned>((rows + 31) / 32 * 32);
  launch_dependent_on(stream(ctx), "decoder", "record_greedy_ids_kernel", record_greedy_ids_kernel, dim3(1), dim3(threads), 0, ids, rows,
                   history, counter, advance, tokens, positions);
}

void argmax_rows_f32(const ExecContext& ctx, const float* logits, int64_t rows, int64_t vocab, int32_t* out) {
  if (rows == 0) return;
  launch_dependent_on(stream(ctx), "decoder", "argmax_rows_kernel", argmax_rows_kernel, dim3(static_cast<unsigned>(rows)),
                   dim3(kArgmaxThreads), 0, logits, vocab, out);
}

}  // namespace kiln::cuda

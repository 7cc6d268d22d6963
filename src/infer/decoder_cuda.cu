#include "infer/decoder_cuda.h"

#include "core/cuda_check.h"
#include "core/cuda_context.h"

#include <cfloat>

namespace kiln::cuda {

namespace {

constexpr int kArgmaxThreads = 512;

// Keeps the larger value; on equal values (and for NaN, which never compares larger) the
// lower index, so the result does not depend on the reduction's order.
__device__ __forceinline__ void better(float& v, int32_t& i, float ov, int32_t oi) {
  if (ov > v || (ov == v && oi < i)) v = ov, i = oi;
}

__global__ void argmax_rows_kernel(const float* __restrict__ logits, int64_t vocab, int32_t* __restrict__ out) {
  const float* row = logits + blockIdx.x * vocab;
  float v = -FLT_MAX;
  int32_t idx = INT32_MAX;
  for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) better(v, idx, row[j], static_cast<int32_t>(j));
  for (int offset = 16; offset > 0; offset >>= 1)
    better(v, idx, __shfl_xor_sync(0xffffffffu, v, offset), __shfl_xor_sync(0xffffffffu, idx, offset));
  __shared__ float values[kArgmaxThreads / 32];
  __shared__ int32_t indices[kArgmaxThreads / 32];
  const int warp = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
  if (lane == 0) values[warp] = v, indices[warp] = idx;
  __syncthreads();
  if (threadIdx.x != 0) return;
  for (int w = 1; w < kArgmaxThreads / 32; ++w) better(v, idx, values[w], indices[w]);
  // A row of NaN or -inf only: the first index, as std::max_element would give.
  out[blockIdx.x] = idx == INT32_MAX ? 0 : idx;
}

}  // namespace

void argmax_rows_f32(const float* logits, int64_t rows, int64_t vocab, int32_t* out) {
  if (rows == 0) return;
  argmax_rows_kernel<<<static_cast<unsigned>(rows), kArgmaxThreads, 0, stream()>>>(logits, vocab, out);
  check_launch("decoder", "argmax_rows_kernel");
}

}  // namespace kiln::cuda

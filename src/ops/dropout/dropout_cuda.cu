// Dropout on the GPU (declared in dropout_cuda.h): one element per thread step; the mask
// is dropout::keeps, the same function the CPU reference calls.
#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "ops/dropout/dropout_cuda.h"
#include "ops/dropout/dropout_mask.h"
#include "ops/grid_stride.cuh"

#include <cuda_bf16.h>

namespace kiln::cuda {

namespace {

using bf16 = __nv_bfloat16;
constexpr int kThreads = 256;

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(bf16 v) { return __bfloat162float(v); }
template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ bf16 from_float<bf16>(float v) { return __float2bfloat16(v); }

template <typename T>
__global__ void dropout_kernel(const T* x, int64_t n, const int32_t* __restrict__ key_words, uint32_t site,
                               uint32_t threshold, float scale, T* y) {
  const uint64_t key = static_cast<uint32_t>(key_words[0]) | static_cast<uint64_t>(static_cast<uint32_t>(key_words[1])) << 32;
  KILN_GRID_STRIDE(i, n) {
    const bool keep = dropout::keeps(key, site, static_cast<uint64_t>(i), threshold);
    y[i] = from_float<T>(keep ? to_float(x[i]) * scale : 0.0f);
  }
}

template <typename T>
void launch(cudaStream_t s, const T* x, int64_t n, const int32_t* key, uint32_t site, uint32_t threshold, float scale, T* y) {
  if (n == 0) return;
  dropout_kernel<T><<<blocks_for(n, kThreads), kThreads, 0, s>>>(x, n, key, site, threshold, scale, y);
  check_launch("dropout", "dropout_kernel");
}

}  // namespace

void dropout_apply_f32(const ExecContext& ctx, const float* x, int64_t n, const int32_t* key, uint32_t site, uint32_t threshold, float scale,
                       float* y) {
  launch(stream(ctx), x, n, key, site, threshold, scale, y);
}

void dropout_apply_bf16(const ExecContext& ctx, const bf16_bits* x, int64_t n, const int32_t* key, uint32_t site, uint32_t threshold,
                        float scale, bf16_bits* y) {
  launch(stream(ctx), reinterpret_cast<const bf16*>(x), n, key, site, threshold, scale, reinterpret_cast<bf16*>(y));
}

}  // namespace kiln::cuda

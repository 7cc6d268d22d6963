// Device helpers shared by the FP8 quantize kernels' translation units (tensorwise in
// fp8_quantize_cuda.cu, blockwise in fp8_quantize_blockwise_cuda.cu): loads that widen to
// f32 exactly, max reductions (exact in any order), the dtype dispatch. The per-element
// cast arithmetic is fp8_cast.cuh's. CUDA translation units only.
#pragma once

#include "core/dtype.h"
#include "core/error.h"
#include "ops/fp8/fp8_format.h"

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace kiln::cuda::fp8_quantize_detail {

using bf16 = __nv_bfloat16;

__device__ __forceinline__ float ld(const float* p) { return *p; }
__device__ __forceinline__ float ld(const bf16* p) { return __bfloat162float(*p); }

__device__ __forceinline__ float warp_max(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Max over the block (blockDim.x a multiple of 32, at most 1024), returned to every thread.
__device__ inline float block_max(float v) {
  __shared__ float warps[32];
  __shared__ float result;
  v = warp_max(v);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warps[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float m = lane < static_cast<int>(blockDim.x / 32) ? warps[lane] : 0.0f;
    m = warp_max(m);
    if (lane == 0) result = m;
  }
  __syncthreads();
  return result;
}

// Eight bf16 (as the raw 16 bytes of one vector load) widened to f32, exactly.
__device__ __forceinline__ void unpack8(const uint4& raw, float v[8]) {
  const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
  for (int j = 0; j < 4; ++j) {
    const float2 f = __bfloat1622float2(pairs[j]);
    v[2 * j] = f.x, v[2 * j + 1] = f.y;
  }
}

// Eight consecutive elements from a 16-byte aligned address (32-byte for f32).
__device__ __forceinline__ void load8(const float* p, float v[8]) {
  const float4 a = *reinterpret_cast<const float4*>(p), b = *reinterpret_cast<const float4*>(p + 4);
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

__device__ __forceinline__ void load8(const bf16* p, float v[8]) { unpack8(*reinterpret_cast<const uint4*>(p), v); }

__host__ __device__ inline bool aligned_to(const void* p, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

inline __nv_fp8_interpretation_t cuda_format(ops::fp8::Format format) {
  return format == ops::fp8::Format::e4m3 ? __NV_E4M3 : __NV_E5M2;
}

// fn.template operator()<T>() with T the element type of dtype (f32 or bf16).
template <typename Fn>
void by_dtype(const char* op, DType dtype, Fn&& fn) {
  if (dtype == DType::f32) fn.template operator()<float>();
  else if (dtype == DType::bf16) fn.template operator()<bf16>();
  else fail(op, "input dtype {} (expected f32 or bf16)", dtype_name(dtype));
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace kiln::cuda::fp8_quantize_detail

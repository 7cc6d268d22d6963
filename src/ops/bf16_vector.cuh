// Loads and stores of the bf16 kernels: W = 1 or 8 consecutive elements of an fp32 or
// bf16 array, as fp32 values in registers (8 bf16 = one 16-byte access, 8 fp32 = two).
// bf16 stores round to nearest even. CUDA translation units only.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace kiln::cuda::vec {

using bf16 = __nv_bfloat16;

constexpr int kWidth = 8;  // elements per vector access

// True when p may be read in 16-byte vectors (a null pointer, an absent input, counts as aligned).
inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(bf16 v) { return __bfloat162float(v); }
__device__ __forceinline__ void from_f32(float v, float* p) { *p = v; }
__device__ __forceinline__ void from_f32(float v, bf16* p) { *p = __float2bfloat16_rn(v); }

__device__ __forceinline__ void load8(const float* p, float (&v)[8]) {
  const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}
__device__ __forceinline__ void load8(const bf16* p, float (&v)[8]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 f = __bfloat1622float2(h[k]);
    v[2 * k] = f.x, v[2 * k + 1] = f.y;
  }
}
__device__ __forceinline__ void store8(float* p, const float (&v)[8]) {
  reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}
__device__ __forceinline__ void store8(bf16* p, const float (&v)[8]) {
  uint4 raw;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
  for (int k = 0; k < 4; ++k) h[k] = __floats2bfloat162_rn(v[2 * k], v[2 * k + 1]);  // .x (low half) = first
  *reinterpret_cast<uint4*>(p) = raw;
}

template <int W, typename T>
__device__ __forceinline__ void load(const T* p, float (&v)[W]) {
  static_assert(W == 1 || W == kWidth);
  if constexpr (W == 1) v[0] = to_f32(*p);
  else load8(p, v);
}
template <int W, typename T>
__device__ __forceinline__ void store(T* p, const float (&v)[W]) {
  static_assert(W == 1 || W == kWidth);
  if constexpr (W == 1) from_f32(v[0], p);
  else store8(p, v);
}

}  // namespace kiln::cuda::vec

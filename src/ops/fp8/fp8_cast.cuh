// The tensorwise cast's per-element arithmetic, shared by every kernel that writes FP8 codes
// (fp8_quantize_cuda.cu, the experts' ops/moe/grouped_gemm_fp8_cuda.cu) so that each gives
// the CPU emulation's bits (ops/fp8/fp8_scaling.cpp): the scale a correctly rounded
// division, x * scale an fp32 multiply that cannot contract into anything (__fmul_rn), the
// cast PTX cvt.rn.satfinite through cuda_fp8.h. CUDA translation units only.
#pragma once

#include <cuda_fp8.h>

#include <cfloat>
#include <cstdint>

namespace kiln::cuda::fp8_cast {

// ops::fp8::scale_from_amax on the device.
__device__ __forceinline__ float scale_from_amax(float amax, float fp8_max) {
  if (amax == 0.0f) return 1.0f;
  const float scale = __fdiv_rn(fp8_max, amax);
  return isinf(scale) ? FLT_MAX : scale;
}

__device__ __forceinline__ uint8_t cast(float x, float scale, __nv_fp8_interpretation_t format) {
  return __nv_cvt_float_to_fp8(__fmul_rn(x, scale), __NV_SATFINITE, format);
}

// Eight codes packed little-endian: code j at byte j, as a row-major store lays them out.
__device__ __forceinline__ uint2 cast8(const float v[8], float scale, __nv_fp8_interpretation_t format) {
  uint32_t word[2] = {0, 0};
  for (int j = 0; j < 8; ++j) word[j / 4] |= uint32_t{cast(v[j], scale, format)} << (8 * (j % 4));
  return make_uint2(word[0], word[1]);
}

}  // namespace kiln::cuda::fp8_cast

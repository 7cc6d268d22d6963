// The AdamW update of one element, shared by the per-tensor and the multi-tensor kernels.
// Every multiply and add is an explicit intrinsic, so the compiler cannot contract them
// differently in the two kernels: both give the same bits.
#pragma once

namespace kiln::cuda {

// Per-tensor factors of the update: decay = 1 - lr wd, step = lr / bc1, 1 / sqrt(bc2).
struct AdamWFactors {
  float decay, step, inv_sqrt_bc2;
};
__device__ __forceinline__ AdamWFactors adamw_factors(float lr, float wd, float bc1, float bc2) {
  return {__fsub_rn(1.0f, __fmul_rn(lr, wd)), __fdiv_rn(lr, bc1), __frsqrt_rn(bc2)};
}

__device__ __forceinline__ void adamw_element(float& p, float g, float& m, float& v, float b1, float b2, float eps,
                                              float decay, float step, float inv_sqrt_bc2) {
  m = __fadd_rn(__fmul_rn(b1, m), __fmul_rn(1.0f - b1, g));
  v = __fadd_rn(__fmul_rn(b2, v), __fmul_rn(__fmul_rn(1.0f - b2, g), g));
  const float denom = __fadd_rn(__fmul_rn(__fsqrt_rn(v), inv_sqrt_bc2), eps);
  p = __fsub_rn(__fmul_rn(p, decay), __fdiv_rn(__fmul_rn(step, m), denom));
}

}  // namespace kiln::cuda

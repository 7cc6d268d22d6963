// CUDA kernels behind ops/optim/adamw.h: the per-tensor update and the multi-tensor one
// (adamw_cuda.cu), both on adamw_element (adamw_math.cuh), so both give the same bits.
#pragma once

#include <cstdint>

namespace kiln::cuda {

void adamw_update_f32(float* p, const float* g, float* m, float* v, int64_t n, float lr, float beta1, float beta2,
                      float eps, float weight_decay, float bias_correction1, float bias_correction2);

// One tensor of a multi-tensor AdamW update (fp32 parameter, gradient and state).
struct AdamWTensorF32 {
  float* p;
  const float* g;
  float* m;
  float* v;
  int64_t n;
  float weight_decay;
};
// Every tensor in one launch; the same arithmetic as adamw_update_f32.
void adamw_update_many_f32(const AdamWTensorF32* tensors, int64_t count, float lr, float beta1, float beta2, float eps,
                           float bias_correction1, float bias_correction2);

// The scalars of one optimizer update read from device memory when the kernel runs (a
// captured step): lr and bias corrections written by the host before the step, the
// gradient factor (the clip; 1 = none) and the skip flag by the step's guard kernel.
struct DeviceUpdateScalars {
  float lr, bias_correction1, bias_correction2;
  float grad_scale;
  int32_t skip;  // nonzero: parameters and state stay untouched
};
// adamw_update_many_f32 with the scalars above: g * grad_scale in place of g (the bits of
// scaling the gradients first), nothing when skip is set.
void adamw_update_many_device_f32(const AdamWTensorF32* tensors, int64_t count, float beta1, float beta2, float eps,
                                  const DeviceUpdateScalars* scalars);

}  // namespace kiln::cuda

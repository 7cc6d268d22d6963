// CUDA kernels behind ops/optim/adamw.h: the per-tensor update and the multi-tensor one
// (adamw_cuda.cu), both on adamw_element (adamw_math.cuh), so both give the same bits.
#pragma once

#include "core/exec_context.h"
#include "ops/optim/update_scalars.h"

#include <cstdint>
#include <memory>

namespace kiln::cuda {

void adamw_update_f32(const ExecContext& ctx, float* p, const float* g, float* m, float* v, int64_t n, float lr, float beta1, float beta2,
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
// The device copy of one optimizer's tensor list and its chunks, rebuilt only when the
// list changes (in training, never after the first step). Each optimizer owns its own, so
// two optimizers' updates in one captured step never rebuild each other's table.
class AdamWTable;
std::shared_ptr<AdamWTable> make_adamw_table();

// Every tensor in one launch; the same arithmetic as adamw_update_f32.
void adamw_update_many_f32(const ExecContext& ctx, AdamWTable& table, const AdamWTensorF32* tensors, int64_t count, float lr, float beta1,
                           float beta2, float eps, float bias_correction1, float bias_correction2);

// adamw_update_many_f32 with the scalars in device memory (ops/optim/update_scalars.h):
// lr and bias corrections from group `group`, g * grad_scale in place of g (the bits of
// scaling the gradients first), nothing when skip is set.
void adamw_update_many_device_f32(const ExecContext& ctx, AdamWTable& table, const AdamWTensorF32* tensors, int64_t count, float beta1,
                                  float beta2, float eps, const ops::DeviceUpdateScalars* scalars, int group);

}  // namespace kiln::cuda

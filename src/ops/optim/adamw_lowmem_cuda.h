// CUDA kernels behind ops/optim/adamw_lowmem.h: every tensor of one storage format in one
// launch, on the arithmetic of ops/optim/adamw_lowmem_math.h (the CPU reference's bits).
#pragma once

#include "core/exec_context.h"
#include "ops/optim/update_scalars.h"

#include <cstdint>
#include <memory>

namespace kiln::cuda {

// One tensor: fp32 parameter and gradient; m, v as bf16 bits (uint16_t) or 8-bit codes
// (uint8_t), with their blocks' absmax for the latter (null for bf16).
struct AdamWLowMemTensorDev {
  float* p;
  const float* g;
  void* m;
  void* v;
  float* m_absmax;
  float* v_absmax;
  int64_t n;
  float weight_decay;
};

// The device copy of one optimizer's list (and, for 8-bit, the two dynamic maps), rebuilt
// only when the list changes, as cuda::AdamWTable.
class AdamWLowMemTable;
std::shared_ptr<AdamWLowMemTable> make_adamw_lowmem_table();

// `int8` false: bf16 moments; true: 8-bit. Scalars from the host (grad scale 1) or from
// device memory (group `group`; nothing when skip is set).
void adamw_lowmem_update_many(const ExecContext& ctx, AdamWLowMemTable& table, bool int8, const AdamWLowMemTensorDev* tensors, int64_t count,
                              float lr, float beta1, float beta2, float eps, float bias_correction1,
                              float bias_correction2);
void adamw_lowmem_update_many_device(const ExecContext& ctx, AdamWLowMemTable& table, bool int8, const AdamWLowMemTensorDev* tensors,
                                     int64_t count, float beta1, float beta2, float eps,
                                     const ops::DeviceUpdateScalars* scalars, int group);

}  // namespace kiln::cuda

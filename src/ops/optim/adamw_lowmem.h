// AdamW with low-memory moments (optim.adamw_state): m and v stored as bf16 (4 bytes a
// parameter instead of 8), or as block-wise 8-bit codes of the dynamic map
// (ops/optim/dynamic_map.h; 2 bytes a parameter plus an fp32 absmax per 256 elements per
// moment, after Dettmers et al. 2021). Each step reads the moments to fp32, updates them
// and the parameter in fp32 (the fp32 AdamW arithmetic: ops/optim/adamw.h), and writes
// them back: bf16 rounded to nearest even; 8-bit as the nearest code of each element over
// its block's new absmax. CPU and GPU compute the same bits
// (ops/optim/adamw_lowmem_math.h). Parameters and gradients are fp32.
#pragma once

#include "core/exec_context.h"
#include "core/tensor.h"
#include "ops/optim/adamw.h"
#include "ops/optim/adamw_lowmem_cuda.h"

#include <memory>
#include <string>
#include <vector>

namespace kiln::ops {

enum class AdamWState { fp32, bf16, int8 };
AdamWState adamw_state_from_name(const std::string& name);  // "fp32" | "bf16" | "int8"

// One tensor's update. bf16: m, v bf16 of the parameter's shape, absmax undefined. int8:
// m, v u8 of its shape (m's codes in the signed map, v's in the unsigned one), m_absmax and
// v_absmax f32 [adamw_lowmem::blocks_of(numel)].
struct AdamWLowMemTensor {
  Tensor param, grad, m, v, m_absmax, v_absmax;
  double weight_decay = 0;
};
using AdamWLowMemDeviceTable = std::shared_ptr<cuda::AdamWLowMemTable>;

// All tensors of one storage format (`state`: bf16 or int8), each with its own weight
// decay (step.weight_decay is ignored): one launch on the GPU, a loop on the CPU.
void adamw_lowmem_update_all(const ExecContext& ctx, AdamWState state, const std::vector<AdamWLowMemTensor>& tensors, const AdamWStep& step,
                             AdamWLowMemDeviceTable& table);

// The GPU form with its scalars in device memory, as adamw_update_all_on_device.
void adamw_lowmem_update_all_on_device(const ExecContext& ctx, AdamWState state, const std::vector<AdamWLowMemTensor>& tensors,
                                       const AdamWStep& fixed, const DeviceUpdateScalars* scalars, int group,
                                       AdamWLowMemDeviceTable& table);

}  // namespace kiln::ops

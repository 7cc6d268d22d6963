// The scalars of one optimizer update kept in device memory, read when the update's
// kernels run (a training step captured as a CUDA graph, train/step_program.h): the
// gradient factor (the clip; 1 = none) and the skip flag, written by the step's guard
// kernel for every optimizer, and each parameter group's learning rate and bias
// corrections, written by the host before the step into that group's own slot.
#pragma once

#include <cstdint>

namespace kiln::ops {

// Parameter groups one step can update (train/optimizer.h: one per distinct setting of
// the roles; there are seven roles).
inline constexpr int kMaxUpdateGroups = 8;

struct GroupUpdateScalars {
  float lr = 0;
  float bias_correction1 = 1, bias_correction2 = 1;  // 1 - beta^t (AdamW; 1 elsewhere)
  // The update's 1-based number: the counter of bf16 masters' stochastic rounding
  // (ops/optim/stochastic_round.h), which a captured step must read when it runs.
  uint32_t update = 0;
};

struct DeviceUpdateScalars {
  float grad_scale = 1;
  int32_t skip = 0;  // nonzero: parameters and state stay untouched
  GroupUpdateScalars group[kMaxUpdateGroups];
};

}  // namespace kiln::ops

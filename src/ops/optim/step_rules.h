// The rules that decide a step's fate, written once for every way a step runs: the fault
// guard's verdict (train/fault_guard.h on the host, the device step's finish kernel in
// step_scalars_cuda.cu) and the gradient clip's factor (the host path, the device step and
// kiln bench). Plain double arithmetic, so the host and the GPU give the same verdict and
// the same factor from the same loss and norm.
#pragma once

#include "core/host_device.h"

#include <cmath>
#include <cstdint>

namespace kiln::ops {

// Why an update is skipped, in the order the rules are checked; apply when none holds.
enum class StepVerdict : int32_t { apply = 0, non_finite_loss, non_finite_grad_norm, loss_spike, grad_spike };

// `loss_limit` and `grad_limit` are the spike guard's (+inf while it is off or its window
// not yet full: FaultGuard::spike_limits).
KILN_HOST_DEVICE inline StepVerdict step_verdict(double loss, double grad_norm, double loss_limit,
                                                 double grad_limit) {
  using std::isfinite;
  if (!isfinite(loss)) return StepVerdict::non_finite_loss;
  if (!isfinite(grad_norm)) return StepVerdict::non_finite_grad_norm;
  if (loss > loss_limit) return StepVerdict::loss_spike;
  if (grad_norm > grad_limit) return StepVerdict::grad_spike;
  return StepVerdict::apply;
}

// optim.grad_clip (0: off) applies when the global norm (before clipping) exceeds it; the
// gradients are then scaled by clip_factor. The 1e-6 keeps the scaled norm just below the
// bound, as torch.nn.utils.clip_grad_norm_ does.
KILN_HOST_DEVICE inline bool clip_applies(double clip, double grad_norm) { return clip > 0 && grad_norm > clip; }
KILN_HOST_DEVICE inline double clip_factor(double clip, double grad_norm) { return clip / (grad_norm + 1e-6); }

}  // namespace kiln::ops

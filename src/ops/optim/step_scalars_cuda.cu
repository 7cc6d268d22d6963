#include "ops/optim/step_scalars.h"

#include "core/cuda_check.h"
#include "core/cuda_context.h"

namespace kiln::ops {

namespace {

__global__ void add_micro_sums_kernel(DeviceStepScalars* s) {
  for (int k = 0; k < kStepLossSlots; ++k) {
    s->step_sums[k] += s->micro_sums[k];
    s->micro_sums[k] = 0;  // the next micro-batch starts from zero, as each host-path call does
  }
}

// One thread: the same double arithmetic as Trainer's host path, so the same values (and
// the same verdict) come out of either.
__global__ void finish_step_kernel(DeviceStepScalars* s) {
  s->loss = s->step_sums[0] / s->targets;
  s->grad_norm = sqrt(s->grad_sum_squares);
  StepVerdict verdict = StepVerdict::apply;
  if (!isfinite(s->loss)) verdict = StepVerdict::non_finite_loss;
  else if (!isfinite(s->grad_norm)) verdict = StepVerdict::non_finite_grad_norm;
  else if (s->loss > s->loss_limit) verdict = StepVerdict::loss_spike;
  else if (s->grad_norm > s->grad_limit) verdict = StepVerdict::grad_spike;
  s->verdict = verdict;
  s->update.skip = verdict != StepVerdict::apply;
  const bool clip = s->clip > 0 && s->grad_norm > s->clip;
  s->update.grad_scale = clip ? static_cast<float>(s->clip / (s->grad_norm + 1e-6)) : 1.0f;
}

}  // namespace

void add_micro_sums_on_device(const ExecContext& ctx, DeviceStepScalars* scalars) {
  add_micro_sums_kernel<<<1, 1, 0, cuda::stream(ctx)>>>(scalars);
  cuda::check_launch("device_step", "add_micro_sums_kernel");
}

void finish_step_on_device(const ExecContext& ctx, DeviceStepScalars* scalars) {
  finish_step_kernel<<<1, 1, 0, cuda::stream(ctx)>>>(scalars);
  cuda::check_launch("device_step", "finish_step_kernel");
}

}  // namespace kiln::ops

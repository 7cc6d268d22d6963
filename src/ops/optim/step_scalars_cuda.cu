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

// One thread: the same double arithmetic as Trainer's host path and the same rules
// (step_rules.h), so the same values and the same verdict come out of either.
__global__ void finish_step_kernel(DeviceStepScalars* s) {
  s->loss = s->step_sums[0] / s->targets;
  s->grad_norm = sqrt(s->grad_sum_squares) / s->scale;
  s->verdict = step_verdict(s->loss, s->grad_norm, s->loss_limit, s->grad_limit);
  s->update.skip = s->verdict != StepVerdict::apply;
  const double clip = clip_applies(s->clip, s->grad_norm) ? clip_factor(s->clip, s->grad_norm) : 1.0;
  s->update.grad_scale = static_cast<float>(clip / s->scale);
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

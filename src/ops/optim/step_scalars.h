// The scalars of one training step kept in device memory (train/step_program.h), so the
// step runs, and replays as CUDA graphs, without the host reading anything until it ends:
// what the host writes before the step, what the LM head accumulates, and what the guard
// kernel decides before the optimizer runs. One copy in, one copy out per step.
#pragma once

#include "core/exec_context.h"
#include "ops/optim/step_rules.h"
#include "ops/optim/update_scalars.h"

#include <cstdint>

namespace kiln::ops {

// Loss slots per micro-batch and step (nn/loss_terms.h's kMaxLossSlots: the model's
// objectives each add into theirs).
inline constexpr int kStepLossSlots = 32;

struct DeviceStepScalars {
  // Written by the host before the step.
  double targets = 0;     // target tokens of the whole step: the loss divisor
  double loss_limit = 0;  // spike guard: skip when loss > loss_limit (+inf: off)
  double grad_limit = 0;  // and when grad_norm > grad_limit
  double clip = 0;        // optim.grad_clip (0: off)
  float loss_scale = 0;   // float(S / targets): the LM head's gradient scale (S: the loss scale)
  // S itself: the router losses' gradient scale (nn/loss_terms.h), and what the norm and
  // the update's gradient factor are divided by (exact: a power of two).
  double scale = 1;
  // The loss slots' sums: of the current micro-batch (zero at its start), and of the step
  // (each micro-batch's added in order, as the host loop adds them). Slot 0 is the main loss.
  double micro_sums[kStepLossSlots] = {};
  double step_sums[kStepLossSlots] = {};
  double grad_sum_squares = 0;
  // Written by finish_step_on_device.
  double loss = 0, grad_norm = 0;
  StepVerdict verdict = StepVerdict::apply;
  // Each group's lr and bias corrections by the host; grad_scale and skip by
  // finish_step_on_device.
  DeviceUpdateScalars update{};
};

// step_sums += micro_sums, then micro_sums = 0 (after a micro-batch's forward and backward).
void add_micro_sums_on_device(const ExecContext& ctx, DeviceStepScalars* scalars);
// loss = step_sums[0] / targets, grad_norm = sqrt(grad_sum_squares) / S; the
// verdict (the fault guard's checks in its order); the update's skip flag and gradient
// factor (clip / (grad_norm + 1e-6) above the clip, else 1; times 1 / S).
void finish_step_on_device(const ExecContext& ctx, DeviceStepScalars* scalars);

}  // namespace kiln::ops

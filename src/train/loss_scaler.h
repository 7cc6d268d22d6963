// Dynamic loss scaling (train.loss_scale = "dynamic"), the scheme of fp16 training
// (Micikevicius et al. 2018; PyTorch's GradScaler): the loss gradient is multiplied by a
// scale S so that small gradients stay above fp16's smallest normal, and the gradients are
// divided by S again before the norm, the guard, the clip and the update
// (train/step_program.h: StepPlan::loss_scale). S is a power of two, so scaling by it and
// back is exact wherever nothing overflows: a run with the scaler is the run without it,
// bit for bit, until a gradient overflows. A non-finite gradient norm at S > 1 is taken
// for an overflow: the update is skipped, S halves, and the fault guard does not count the
// skip (its limit is for faults that backing off cannot cure: at S = 1 it counts again).
// After train.loss_scale_growth_interval applied steps without one, S doubles.
//
// The state is part of a checkpoint, so a resumed run scales as one that never stopped.
#pragma once

#include "config/config.h"
#include "ops/optim/step_rules.h"

#include <cstdint>

namespace kiln {

struct LossScalerState {
  double scale = 1;
  int64_t clean_steps = 0;  // applied steps since the last change of scale
  int64_t overflows = 0;    // skipped steps that halved the scale, in all
  bool operator==(const LossScalerState&) const = default;
};

class LossScaler {
 public:
  explicit LossScaler(const TrainConfig& config);

  bool enabled() const { return enabled_; }
  // The scale of the next step: 1 while scaling is off.
  double scale() const { return state_.scale; }
  // After a step with `verdict`: true when its skip was an overflow of this scale (which
  // then halves).
  bool after_step(ops::StepVerdict verdict);

  const LossScalerState& state() const { return state_; }
  void restore(const LossScalerState& state);

 private:
  bool enabled_;
  int64_t growth_interval_;
  LossScalerState state_;
};

}  // namespace kiln

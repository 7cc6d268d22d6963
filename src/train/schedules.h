// Learning-rate schedules, built by name (optim.schedule) through a registry: the rate of
// each optimizer step from the config and the run's total steps. A schedule is a pure
// function of (step, total), so a resumed run with a larger train.steps continues on the
// retargeted schedule.
#pragma once

#include "config/config.h"
#include "nn/registry.h"

#include <cstdint>

namespace kiln {

class Schedule {
 public:
  virtual ~Schedule() = default;
  // Learning rate for optimizer step `step` (0-based) of `total`.
  virtual double lr(int64_t step) const = 0;
};

using ScheduleRegistry = Registry<Schedule, const OptimConfig&, int64_t>;

ScheduleRegistry& schedule_registry();

// optim.schedule for a run of `total_steps` optimizer steps of `tokens_per_step` tokens
// each (the step's token budget: micro-batch tokens x grad_accum x data-parallel ranks):
// optim.warmup_tokens and optim.decay_tokens, where > 0, become warmup_steps and
// decay_steps, rounded up to whole steps. Tokens keep a schedule's meaning when the batch
// size changes; the steps it becomes follow the batch.
std::unique_ptr<Schedule> make_schedule(const OptimConfig& config, int64_t total_steps, int64_t tokens_per_step);

}  // namespace kiln

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

}  // namespace kiln

// Optimizers and learning-rate schedules, built by name from the config through registries.
#pragma once

#include "core/arena.h"
#include "nn/parameter.h"
#include "nn/registry.h"
#include "train/config.h"

#include <memory>
#include <vector>

namespace kiln {

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  // Plans optimizer state in `state` (called once, before the arena allocates).
  virtual void plan(Arena& state) = 0;
  // One update of every parameter from its gradient, at learning rate `lr`.
  virtual void step(double lr) = 0;
  // Completed updates (bias correction and checkpoints need it).
  virtual int64_t steps_taken() const = 0;
};

class Schedule {
 public:
  virtual ~Schedule() = default;
  // Learning rate for optimizer step `step` (0-based) of `total`.
  virtual double lr(int64_t step) const = 0;
};

using ParameterList = std::vector<std::unique_ptr<Parameter>>;
using OptimizerRegistry = Registry<Optimizer, const OptimConfig&, const ParameterList&>;
using ScheduleRegistry = Registry<Schedule, const OptimConfig&, int64_t>;

OptimizerRegistry& optimizer_registry();
ScheduleRegistry& schedule_registry();

// Whether weight decay applies to a parameter under this config: matrices yes, 1-D gains
// and biases only with decay_norms, the embedding (and a tied head) only with decay_embeddings.
bool applies_weight_decay(const Parameter& p, const OptimConfig& config);

// Global L2 norm of all gradients; if clip > 0 and the norm exceeds it, gradients are
// scaled down to norm `clip`. Returns the norm before clipping.
double clip_gradients(const ParameterList& parameters, double clip);

}  // namespace kiln

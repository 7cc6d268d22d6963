// Optimizers, built by name from the config through a registry (learning-rate schedules:
// train/schedules.h).
#pragma once

#include "core/arena.h"
#include "nn/parameter.h"
#include "nn/registry.h"
#include "ops/optim/update_scalars.h"
#include "config/config.h"
#include "train/schedules.h"

#include <memory>
#include <vector>

namespace kiln {

// One tensor of optimizer state under a whole-model name ("<parameter>.exp_avg"), so a
// checkpoint does not depend on how parameters are laid out or sharded.
struct OptimizerStateTensor {
  std::string name;
  Tensor tensor;
};

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  // Plans optimizer state in `state` (called once, before the arena allocates).
  virtual void plan(Arena& state) = 0;
  // One update of every parameter from its gradient, at learning rate `lr`.
  virtual void step(double lr) = 0;
  // Completed updates (bias correction and checkpoints need it).
  virtual int64_t steps_taken() const = 0;
  // Checkpoints: every state tensor by name (after plan(); bound once the arena is
  // allocated), and the step count restored on resume.
  virtual std::vector<OptimizerStateTensor> state_tensors() const = 0;
  virtual void set_steps_taken(int64_t steps) = 0;

  // A step whose scalars stay on the device (train/device_step.h): whether this optimizer
  // can update with them; the lr and bias corrections of the next update (number
  // steps_taken() + 1) into the host copy of `scalars`; the update itself, enqueued,
  // reading `scalars` in device memory (where the guard may have set skip: so the host
  // calls count_update() only once it knows the update was applied).
  virtual bool updates_on_device() const { return false; }
  virtual void prepare_device_update(double lr, ops::DeviceUpdateScalars& scalars) const;
  virtual void step_on_device(const ops::DeviceUpdateScalars* scalars);
  virtual void count_update();
};

using ParameterList = std::vector<std::unique_ptr<Parameter>>;
using OptimizerRegistry = Registry<Optimizer, const OptimConfig&, const ParameterList&>;

OptimizerRegistry& optimizer_registry();

// Whether weight decay applies to a parameter under this config: matrices yes, 1-D gains
// and biases only with decay_norms, the embedding (and a tied head) only with decay_embeddings.
bool applies_weight_decay(const Parameter& p, const OptimConfig& config);

// The global gradient norm and clipping are Model::gradient_norm / scale_gradients.

}  // namespace kiln

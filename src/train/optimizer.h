// Optimizers. Each instance updates one parameter group: the parameters of the roles
// (nn/param_role.h) whose [optim.<role>] settings resolve alike (train/optimizer_groups.h
// builds the groups and the one Optimizer the trainer sees over them). Optimizers are
// built by name through a registry; schedules are in train/schedules.h.
#pragma once

#include "core/arena.h"
#include "nn/parameter.h"
#include "nn/registry.h"
#include "ops/optim/update_scalars.h"
#include "config/config.h"

#include <memory>
#include <string>
#include <vector>

namespace kiln {

// One tensor of optimizer state under a whole-model name ("<parameter>.exp_avg"), so a
// checkpoint does not depend on how parameters are laid out, grouped or sharded. Under
// ZeRO a rank holds a slice of it: `tensor` is elements [offset, offset + numel) of a
// tensor of shape `whole`.
struct OptimizerStateTensor {
  std::string name;
  Tensor tensor;
  bool sliced = false;
  Shape whole;         // when sliced
  int64_t offset = 0;  // when sliced, in elements
};

class ParameterShards;

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  // Plans optimizer state in `state` (called once, before the arena allocates).
  virtual void plan(Arena& state) = 0;
  // One update of every parameter from its gradient, at learning rate `lr` (the
  // schedule's; a group scales it by its lr_scale).
  virtual void step(double lr) = 0;
  // Completed updates (bias correction and checkpoints need it).
  virtual int64_t steps_taken() const = 0;
  // Checkpoints: every state tensor by name (after plan(); bound once the arena is
  // allocated), and the step count restored on resume.
  virtual std::vector<OptimizerStateTensor> state_tensors() const = 0;
  virtual void set_steps_taken(int64_t steps) = 0;

  // A step whose scalars stay on the device (train/step_program.h): whether this optimizer
  // can update with them; the lr (and bias corrections) of the next update (number
  // steps_taken() + 1) into its group's slot of the host copy of `scalars`; the update
  // itself, enqueued, reading `scalars` in device memory (where the guard may have set
  // skip: so the host calls count_update() only once it knows the update was applied).
  virtual bool updates_on_device() const { return false; }
  virtual void prepare_device_update(double lr, ops::DeviceUpdateScalars& scalars) const;
  virtual void step_on_device(const ops::DeviceUpdateScalars* scalars);
  virtual void count_update();
};

// What one optimizer instance updates, and with what, resolved from the config.
struct OptimizerGroup {
  int index = 0;                    // its slot in ops::DeviceUpdateScalars::group
  std::string optimizer;            // registry name
  std::vector<ParamRole> roles;     // in kTrainedRoles order
  double lr_scale = 1.0;            // of the schedule's learning rate
  double weight_decay = 0;          // decoupled, for every parameter of the group
  double beta1 = 0.9, beta2 = 0.95; // AdamW's moments; Muon's momentum is beta1
  const OptimConfig* config = nullptr;  // the rest: eps, [optim.muon]
  std::vector<const Parameter*> parameters;  // trainable, in model order
  const ExecContext* exec = &process_exec();  // where its updates run: the model's context
  // ZeRO (train/parameter_shards.h): this rank updates only its pieces of the parameters
  // and keeps state for them alone. Null: every parameter whole.
  const ParameterShards* shards = nullptr;
  int shard_rank = 0;
  // The section whose key chose this optimizer, for errors ("optim.matrix.optimizer").
  std::string key() const;
};

using OptimizerRegistry = Registry<Optimizer, const OptimizerGroup&>;
OptimizerRegistry& optimizer_registry();

// What the groups need to know of an optimizer before building it.
struct OptimizerTraits {
  // The roles it takes when a role's optimizer is "auto" and optim.name names it (Muon:
  // the matrices; every other role then goes to AdamW).
  std::vector<ParamRole> default_roles;
  bool matrices_only = false;  // updates 2-D matrices only
  // A role's beta1 when it gives -1 (AdamW: optim.beta1; Muon: optim.muon.momentum), and
  // whether beta2 means anything to it.
  double (*default_beta1)(const OptimConfig&) = nullptr;
  bool uses_beta2 = false;
  // muP (nn/mup.h): whether its learning rate of a width-fan-in matrix scales by base /
  // width. AdamW's per-coordinate update is width-independent, so its effect on a matrix's
  // output grows with fan-in; Muon's update is orthogonalized and RMS-matched per shape, and
  // seed 004 transfers it unscaled.
  bool mup_scales_lr = false;
  // Its update reads each tensor whole (Muon orthogonalizes a matrix): ZeRO gives each such
  // tensor to one rank, never a part of it to several (train/parameter_shards.h).
  bool whole_tensors = false;
};
const OptimizerTraits& optimizer_traits(const std::string& name);

using ParameterList = std::vector<std::unique_ptr<Parameter>>;

// The global gradient norm and clipping are Model::gradient_norm / scale_gradients.

}  // namespace kiln

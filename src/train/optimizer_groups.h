// Parameter groups by role. Each trained role's [optim.<role>] settings are resolved
// against [optim] (an "auto" optimizer, the -1 values); the roles that resolve alike share
// one group, and so one optimizer instance with its own state, device scalars and tables.
// make_optimizer builds the model's optimizer over them: what the trainer, `kiln plan`
// and the memory check see.
#pragma once

#include "train/optimizer.h"

#include <memory>
#include <string>
#include <vector>

namespace kiln {

// The groups of `parameters` (trainable ones; roles without any are left out), in
// kTrainedRoles order of their first role. Throws naming the key for an unknown optimizer
// or a role an optimizer cannot update.
std::vector<OptimizerGroup> group_parameters(const OptimConfig& config, const ParameterList& parameters);

std::unique_ptr<Optimizer> make_optimizer(const ExecContext& exec, const OptimConfig& config,
                                          const ParameterList& parameters);

// One line per group for the training banner: "muon [matrix, expert]: 42 tensors, lr x1, weight decay 0.1, beta1 0.95".
std::vector<std::string> describe_groups(const std::vector<OptimizerGroup>& groups);

}  // namespace kiln

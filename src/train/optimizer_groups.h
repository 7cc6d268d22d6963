// Parameter groups by role. Each trained role's [optim.<role>] settings are resolved
// against [optim] (an "auto" optimizer, the -1 values); the roles that resolve alike share
// one group, and so one optimizer instance with its own state, device scalars and tables.
// make_optimizer builds the model's optimizer over them: what the trainer, `kiln plan`
// and the memory check see.
#pragma once

#include "train/optimizer.h"
#include "train/parameter_shards.h"

#include <memory>
#include <string>
#include <vector>

namespace kiln {

// The groups of `parameters` (trainable ones; roles without any are left out), in
// kTrainedRoles order of their first role. Throws naming the key for an unknown optimizer
// or a role an optimizer cannot update. `mup_width_ratio` is nn/mup.h's W / B (1 = muP
// off): an optimizer that scales under muP (AdamW) gets lr_scale x 1 / it on the roles
// whose fan-in is the width, so those roles form groups of their own.
std::vector<OptimizerGroup> group_parameters(const OptimConfig& config, const ParameterList& parameters,
                                             double mup_width_ratio);

// ZeRO's shards of `parameters` at `world_size` ranks (train/parameter_shards.h): cuts on
// AdamW's int8 blocks, and the tensors of an optimizer that needs them whole (Muon) never cut.
ParameterShards make_parameter_shards(const OptimConfig& config, const ParameterList& parameters,
                                      double mup_width_ratio, int world_size);

// `shards` (ZeRO; null: none): every group updates only rank `shard_rank`'s pieces.
std::unique_ptr<Optimizer> make_optimizer(const ExecContext& exec, const OptimConfig& config,
                                          const ParameterList& parameters, double mup_width_ratio,
                                          const ParameterShards* shards = nullptr, int shard_rank = 0);

// One line per group for the training banner, with the peak learning rate each gets
// (optim.lr x its scale): "muon [matrix, expert]: 42 tensors, lr 0.004 (x1), weight decay 0.1, beta1 0.95".
std::vector<std::string> describe_groups(const std::vector<OptimizerGroup>& groups, double lr);

}  // namespace kiln

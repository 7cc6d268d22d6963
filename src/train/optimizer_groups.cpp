#include "train/optimizer_groups.h"

#include "core/phase_scope.h"
#include "nn/mup.h"
#include "ops/optim/adamw_lowmem_math.h"

#include <algorithm>
#include <set>
#include <tuple>

namespace kiln {

namespace {

const RoleOptimConfig& role_config(const OptimConfig& c, ParamRole role) {
  switch (role) {
    case ParamRole::embedding: return c.embedding;
    case ParamRole::head: return c.head;
    case ParamRole::matrix: return c.matrix;
    case ParamRole::expert: return c.expert;
    case ParamRole::router: return c.router;
    case ParamRole::norm: return c.norm;
    case ParamRole::bias: return c.bias;
    case ParamRole::state: break;
  }
  fail("optimizer", "role {} is not trained", role_name(role));
}

// A role's settings with "auto" and -1 resolved.
OptimizerGroup resolve(const OptimConfig& c, ParamRole role, double mup_width_ratio) {
  const RoleOptimConfig& r = role_config(c, role);
  const std::string key = fmt::format("optim.{}.optimizer", role_name(role));
  OptimizerGroup g;
  g.roles = {role};
  g.config = &c;
  if (r.optimizer == "auto") {
    KILN_CHECK(optimizer_registry().contains(c.name), "config", "optim.name: unknown optimizer '{}' (known: {})",
               printable(c.name), optimizer_registry().known());
    const auto& takes = optimizer_traits(c.name).default_roles;
    g.optimizer = std::find(takes.begin(), takes.end(), role) != takes.end() ? c.name : "adamw";
  } else {
    KILN_CHECK(optimizer_registry().contains(r.optimizer), "config", "{}: unknown optimizer '{}' (known: {})", key,
               printable(r.optimizer), optimizer_registry().known());
    g.optimizer = r.optimizer;
  }
  const OptimizerTraits& traits = optimizer_traits(g.optimizer);
  g.lr_scale = r.lr_scale;
  if (traits.mup_scales_lr && mup_scales_role(role)) g.lr_scale /= mup_width_ratio;
  g.weight_decay = r.weight_decay == -1 ? c.weight_decay : r.weight_decay;
  g.beta1 = r.beta1 == -1 ? traits.default_beta1(c) : r.beta1;
  g.beta2 = r.beta2 == -1 ? c.beta2 : r.beta2;
  return g;
}

auto settings(const OptimizerGroup& g) { return std::tie(g.optimizer, g.lr_scale, g.weight_decay, g.beta1, g.beta2); }

// The optimizer the trainer sees: every group's instance, stepped in group order, with one
// update count (all groups update together).
class GroupedOptimizer final : public Optimizer {
 public:
  explicit GroupedOptimizer(std::vector<OptimizerGroup> groups) : groups_(std::move(groups)) {
    for (const OptimizerGroup& g : groups_) members_.push_back(optimizer_registry().build(g.key(), g.optimizer, g));
  }

  void plan(Arena& state) override {
    for (auto& m : members_) m->plan(state);
  }
  void step(double lr) override {
    KILN_PHASE("optimizer");
    for (size_t i = 0; i < members_.size(); ++i) members_[i]->step(lr * groups_[i].lr_scale);
  }
  int64_t steps_taken() const override { return members_.empty() ? steps_ : members_.front()->steps_taken(); }
  void set_steps_taken(int64_t steps) override {
    steps_ = steps;
    for (auto& m : members_) m->set_steps_taken(steps);
  }
  std::vector<OptimizerStateTensor> state_tensors() const override {
    std::vector<OptimizerStateTensor> out;
    for (const auto& m : members_) {
      std::vector<OptimizerStateTensor> part = m->state_tensors();
      out.insert(out.end(), std::make_move_iterator(part.begin()), std::make_move_iterator(part.end()));
    }
    return out;
  }
  bool updates_on_device() const override {
    return !members_.empty() &&
           std::all_of(members_.begin(), members_.end(), [](const auto& m) { return m->updates_on_device(); });
  }
  void prepare_device_update(double lr, ops::DeviceUpdateScalars& scalars) const override {
    for (size_t i = 0; i < members_.size(); ++i) members_[i]->prepare_device_update(lr * groups_[i].lr_scale, scalars);
  }
  void step_on_device(const ops::DeviceUpdateScalars* scalars) override {
    KILN_PHASE("optimizer");
    for (auto& m : members_) m->step_on_device(scalars);
  }
  void count_update() override {
    ++steps_;
    for (auto& m : members_) m->count_update();
  }

 private:
  std::vector<OptimizerGroup> groups_;
  std::vector<std::unique_ptr<Optimizer>> members_;
  int64_t steps_ = 0;  // only without members (a model with nothing to train)
};

}  // namespace

std::vector<OptimizerGroup> group_parameters(const OptimConfig& config, const ParameterList& parameters,
                                             double mup_width_ratio) {
  std::vector<OptimizerGroup> groups;
  for (const ParamRole role : kTrainedRoles) {
    OptimizerGroup resolved = resolve(config, role, mup_width_ratio);
    std::vector<const Parameter*> members;
    for (const auto& p : parameters)
      if (p->trainable() && p->role() == role) members.push_back(p.get());
    if (members.empty()) continue;
    if (optimizer_traits(resolved.optimizer).matrices_only)
      for (const Parameter* p : members)
        KILN_CHECK(p->shape().rank() == 2, "config", "{}: {} updates 2-D matrices only, but role {} holds {} ({})",
                   resolved.key(), resolved.optimizer, role_name(role), p->name(), p->shape().str());
    auto same = std::find_if(groups.begin(), groups.end(),
                             [&](const OptimizerGroup& g) { return settings(g) == settings(resolved); });
    if (same == groups.end()) {
      KILN_CHECK(static_cast<int>(groups.size()) < ops::kMaxUpdateGroups, "config",
                 "more than {} distinct optimizer groups", ops::kMaxUpdateGroups);
      resolved.index = static_cast<int>(groups.size());
      groups.push_back(std::move(resolved));
      same = groups.end() - 1;
    } else {
      same->roles.push_back(role);
    }
    same->parameters.insert(same->parameters.end(), members.begin(), members.end());
  }
  // Model order within a group (roles were gathered one after another).
  for (OptimizerGroup& g : groups) {
    std::vector<const Parameter*> ordered;
    for (const auto& p : parameters)
      if (std::find(g.parameters.begin(), g.parameters.end(), p.get()) != g.parameters.end())
        ordered.push_back(p.get());
    g.parameters = std::move(ordered);
  }
  return groups;
}

std::unique_ptr<Optimizer> make_optimizer(const ExecContext& exec, const OptimConfig& config,
                                          const ParameterList& parameters, double mup_width_ratio,
                                          const ParameterShards* shards, int shard_rank) {
  std::vector<OptimizerGroup> groups = group_parameters(config, parameters, mup_width_ratio);
  for (OptimizerGroup& g : groups) {
    g.exec = &exec;
    g.shards = shards;
    g.shard_rank = shard_rank;
  }
  return std::make_unique<GroupedOptimizer>(std::move(groups));
}

ParameterShards make_parameter_shards(const OptimConfig& config, const ParameterList& parameters,
                                      double mup_width_ratio, int world_size) {
  std::set<const Parameter*> whole;
  for (const OptimizerGroup& g : group_parameters(config, parameters, mup_width_ratio))
    if (optimizer_traits(g.optimizer).whole_tensors) whole.insert(g.parameters.begin(), g.parameters.end());
  std::vector<const Parameter*> trainable;
  std::vector<bool> keep_whole;
  for (const auto& p : parameters)
    if (p->trainable()) {
      trainable.push_back(p.get());
      keep_whole.push_back(whole.count(p.get()) != 0);
    }
  return ParameterShards(trainable, world_size, adamw_lowmem::kBlock, keep_whole);
}

std::vector<std::string> describe_groups(const std::vector<OptimizerGroup>& groups, double lr) {
  std::vector<std::string> lines;
  for (const OptimizerGroup& g : groups) {
    std::string roles;
    for (const ParamRole r : g.roles) roles += fmt::format("{}{}", roles.empty() ? "" : ", ", role_name(r));
    // AdamW's moment format, when not the default fp32 (optim.adamw_state).
    const bool lowmem = g.optimizer == "adamw" && g.config != nullptr && g.config->adamw_state != "fp32";
    lines.push_back(fmt::format("{} [{}]: {} tensors, lr {:.6g} (x{:.6g}), weight decay {}, beta1 {}{}{}", g.optimizer,
                                roles, g.parameters.size(), lr * g.lr_scale, g.lr_scale, g.weight_decay, g.beta1,
                                optimizer_traits(g.optimizer).uses_beta2 ? fmt::format(", beta2 {}", g.beta2)
                                                                         : std::string(),
                                lowmem ? ", moments " + g.config->adamw_state : std::string()));
  }
  return lines;
}

}  // namespace kiln

// Parameter roles and optimizer groups (train/optimizer_groups.h): each component gives
// its parameters a role, roles resolve to groups by their [optim.<role>] settings, and a
// group's learning rate and weight decay reach only its own parameters.
#include "grad_check.h"
#include "test_util.h"
#include "tiny_model.h"

#include "config/config.h"
#include "core/arena.h"
#include "train/optimizer_groups.h"

#include <gtest/gtest.h>

#include <map>

namespace kiln {
namespace {

using test::init_tiny_model;
using test::pack_docs;
using test::tiny_build;
using test::tiny_config;
using test::values_of;

// Two layers: the first dense, the second sparse, with q/k norms and attention biases,
// an untied head: every role there is.
ModelConfig every_role_config() {
  ModelConfig c = tiny_config(true, false);
  c.mlp = "moe";
  c.moe.experts = 4;
  c.moe.top_k = 2;
  c.moe.expert_hidden = 6;
  c.moe.shared_hidden = 5;
  c.moe.router = "softmax_topk";
  return c;
}

std::map<std::string, ParamRole> roles_by_name(const Model& m) {
  std::map<std::string, ParamRole> roles;
  for (const auto& p : m.parameters()) roles[p->name()] = p->role();
  return roles;
}

TEST(OptimizerGroups, EachComponentGivesItsParametersTheirRole) {
  Model m(every_role_config(), tiny_build());
  const auto roles = roles_by_name(m);
  const std::map<std::string, ParamRole> expected = {
      {"embed.weight", ParamRole::embedding},
      {"lm_head.weight", ParamRole::head},
      {"layers.0.attn.q_proj.weight", ParamRole::matrix},
      {"layers.0.attn.v_proj.weight", ParamRole::matrix},
      {"layers.0.attn.o_proj.weight", ParamRole::matrix},
      {"layers.0.attn.k_proj.bias", ParamRole::bias},
      {"layers.0.attn.q_norm.weight", ParamRole::norm},
      {"layers.0.attn_norm.weight", ParamRole::norm},
      {"layers.1.mlp.gate.weight", ParamRole::router},
      {"layers.1.mlp.experts.3.down_proj.weight", ParamRole::expert},
      {"layers.1.mlp.experts.0.gate_proj.weight", ParamRole::expert},
      {"layers.1.mlp.shared_experts.up_proj.weight", ParamRole::matrix},
      {"final_norm.weight", ParamRole::norm},
  };
  for (const auto& [name, role] : expected) {
    const auto it = roles.find(name);
    ASSERT_NE(it, roles.end()) << name;
    EXPECT_EQ(role_name(it->second), role_name(role)) << name;
  }
}

TEST(OptimizerGroups, DefaultsSplitDecayedFromUndecayedRolesUnderAdamW) {
  Model m(every_role_config(), tiny_build());
  const OptimConfig c;
  const std::vector<OptimizerGroup> groups = group_parameters(c, m.parameters(), 1.0);
  ASSERT_EQ(groups.size(), 2u);
  // The embedding comes first, so its (undecayed) group is group 0.
  EXPECT_EQ(groups[0].roles, (std::vector<ParamRole>{ParamRole::embedding, ParamRole::router, ParamRole::norm,
                                                     ParamRole::bias}));
  EXPECT_EQ(groups[0].weight_decay, 0.0);
  EXPECT_EQ(groups[1].roles, (std::vector<ParamRole>{ParamRole::head, ParamRole::matrix, ParamRole::expert}));
  EXPECT_EQ(groups[1].weight_decay, c.weight_decay);
  size_t total = 0;
  for (const OptimizerGroup& g : groups) {
    EXPECT_EQ(g.optimizer, "adamw");
    EXPECT_EQ(g.beta1, c.beta1);
    EXPECT_EQ(g.beta2, c.beta2);
    total += g.parameters.size();
  }
  size_t trainable = 0;
  for (const auto& p : m.parameters()) trainable += p->trainable() ? 1 : 0;
  EXPECT_EQ(total, trainable);
}

TEST(OptimizerGroups, ARoleWithItsOwnSettingsGetsItsOwnGroup) {
  Model m(every_role_config(), tiny_build());
  OptimConfig c;
  c.router.lr_scale = 0.5;
  c.expert.beta2 = 0.99;
  const std::vector<OptimizerGroup> groups = group_parameters(c, m.parameters(), 1.0);
  ASSERT_EQ(groups.size(), 4u);
  EXPECT_EQ(groups[2].roles, std::vector<ParamRole>{ParamRole::expert});
  EXPECT_EQ(groups[2].beta2, 0.99);
  EXPECT_EQ(groups[3].roles, std::vector<ParamRole>{ParamRole::router});
  EXPECT_EQ(groups[3].lr_scale, 0.5);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(groups[static_cast<size_t>(i)].index, i);
}

TEST(OptimizerGroups, AnUnknownOptimizerIsRefusedNamingItsKey) {
  Model m(every_role_config(), tiny_build());
  OptimConfig c;
  c.norm.optimizer = "sgd";
  EXPECT_NE(test::error_of([&] { group_parameters(c, m.parameters(), 1.0); })
                .find("optim.norm.optimizer: unknown optimizer 'sgd'"),
            std::string::npos);
  c = OptimConfig();
  c.name = "lion";
  EXPECT_NE(test::error_of([&] { group_parameters(c, m.parameters(), 1.0); }).find("optim.name: unknown optimizer 'lion'"),
            std::string::npos);
}

// Every parameter's values before and after one step of an optimizer built from `c`.
struct OneStep {
  std::map<std::string, std::vector<double>> before, after;
};
OneStep one_step(const OptimConfig& c) {
  Model m(every_role_config(), tiny_build());
  Arena state("optimizer", Device::cpu);
  auto optimizer = make_optimizer(m.exec(), c, m.parameters(), 1.0);
  optimizer->plan(state);
  m.allocate();
  state.allocate();
  init_tiny_model(m, 11);
  OneStep out;
  for (const auto& p : m.parameters()) out.before[p->name()] = values_of(p->value());
  m.load_batch(pack_docs(test::three_docs(), 4));
  m.zero_grads();
  m.forward_backward(0.05);
  optimizer->step(1e-2);
  for (const auto& p : m.parameters()) out.after[p->name()] = values_of(p->value());
  return out;
}

// A group's lr_scale and weight decay reach its own parameters and no others. Without
// decay AdamW's first step moves an element by lr g / (|g| + eps): doubling the matrices'
// lr doubles their change. The norms' decay of 0.5 adds -lr 0.5 p to theirs. Every other
// role's values come out bitwise the same.
TEST(OptimizerGroups, AGroupsLearningRateAndDecayReachOnlyItsRoles) {
  const double lr = 1e-2;
  OptimConfig base;
  base.matrix.weight_decay = 0;
  OptimConfig scaled = base;
  scaled.matrix.lr_scale = 2.0;
  scaled.norm.weight_decay = 0.5;
  const OneStep a = one_step(base), b = one_step(scaled);
  const auto roles = roles_by_name(Model(every_role_config(), tiny_build()));
  int64_t matrices = 0, norms = 0, others = 0;
  for (const auto& [name, before] : a.before) {
    const std::vector<double>&after_a = a.after.at(name), &after_b = b.after.at(name);
    ASSERT_EQ(b.before.at(name), before) << name;
    const ParamRole role = roles.at(name);
    for (size_t i = 0; i < before.size(); ++i) {
      const double da = after_a[i] - before[i], db = after_b[i] - before[i];
      if (role == ParamRole::matrix) EXPECT_NEAR(db, 2 * da, 1e-12) << name << "[" << i << "]";
      else if (role == ParamRole::norm) EXPECT_NEAR(db - da, -lr * 0.5 * before[i], 1e-12) << name << "[" << i << "]";
    }
    if (role == ParamRole::matrix) ++matrices;
    else if (role == ParamRole::norm) ++norms;
    else if (++others; true) EXPECT_EQ(after_a, after_b) << name;
  }
  EXPECT_GT(matrices, 5);
  EXPECT_GT(norms, 3);
  EXPECT_GT(others, 5);
}

}  // namespace
}  // namespace kiln

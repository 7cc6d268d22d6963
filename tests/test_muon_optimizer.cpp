// Muon as the matrices' optimizer of a model (train/muon_optimizer.cpp): which roles it
// takes, what it refuses, the RMS of its first update under each scaling, and that a run
// learns. The numerics of the update itself are tests/test_muon.cpp's.
#include "grad_check.h"
#include "test_util.h"
#include "tiny_model.h"

#include "config/config.h"
#include "core/arena.h"
#include "train/optimizer_groups.h"

#include <gtest/gtest.h>

#include <cmath>

namespace kiln {
namespace {

using test::init_tiny_model;
using test::pack_docs;
using test::tiny_build;
using test::values_of;

ModelConfig moe_tiny() {
  ModelConfig c = test::tiny_config(true, false);
  c.hidden = 16;
  c.ffn_hidden = 24;
  c.mlp = "moe";
  c.moe.experts = 4;
  c.moe.top_k = 2;
  c.moe.expert_hidden = 6;
  c.moe.shared_hidden = 5;
  return c;
}

TEST(MuonOptimizer, TakesTheMatricesAndLeavesTheRestToAdamW) {
  Model m(moe_tiny(), tiny_build());
  OptimConfig c;
  c.name = "muon";
  const std::vector<OptimizerGroup> groups = group_parameters(c, m.parameters(), 1.0);
  ASSERT_EQ(groups.size(), 3u);
  EXPECT_EQ(groups[0].optimizer, "adamw");
  EXPECT_EQ(groups[0].roles, (std::vector<ParamRole>{ParamRole::embedding, ParamRole::router, ParamRole::norm,
                                                     ParamRole::bias}));
  EXPECT_EQ(groups[1].optimizer, "adamw");
  EXPECT_EQ(groups[1].roles, std::vector<ParamRole>{ParamRole::head});
  EXPECT_EQ(groups[2].optimizer, "muon");
  EXPECT_EQ(groups[2].roles, (std::vector<ParamRole>{ParamRole::matrix, ParamRole::expert}));
  EXPECT_EQ(groups[2].beta1, c.muon.momentum);  // a Muon role's beta1 is its momentum
  EXPECT_EQ(groups[2].weight_decay, c.weight_decay);
  for (const Parameter* p : groups[2].parameters) EXPECT_EQ(p->shape().rank(), 2) << p->name();
}

TEST(MuonOptimizer, ARoleOfVectorsIsRefusedNamingItsKey) {
  Model m(moe_tiny(), tiny_build());
  OptimConfig c;
  c.norm.optimizer = "muon";
  const std::string e = test::error_of([&] { group_parameters(c, m.parameters(), 1.0); });
  EXPECT_NE(e.find("optim.norm.optimizer: muon updates 2-D matrices only, but role norm holds"), std::string::npos) << e;
}

// Every matrix's first update (wd 0) under a scaling, from the same init and batch.
std::vector<std::vector<double>> first_updates(const std::string& scale, double lr) {
  Model m(moe_tiny(), tiny_build());
  OptimConfig c;
  c.name = "muon";
  c.matrix.weight_decay = c.expert.weight_decay = 0;
  c.muon.scale = scale;
  Arena state("optimizer", Device::cpu);
  auto optimizer = make_optimizer(m.exec(), c, m.parameters(), 1.0);
  optimizer->plan(state);
  m.allocate();
  state.allocate();
  init_tiny_model(m, 3);
  std::vector<std::vector<double>> before;
  for (const auto& p : m.parameters()) before.push_back(values_of(p->value()));
  m.load_batch(pack_docs(test::three_docs(), 4));
  m.zero_grads();
  m.forward_backward(0.05);
  optimizer->step(lr);
  std::vector<std::vector<double>> updates;
  for (size_t i = 0; i < m.parameters().size(); ++i) {
    std::vector<double> d = values_of(m.parameters()[i]->value());
    for (size_t j = 0; j < d.size(); ++j) d[j] -= before[i][j];
    updates.push_back(std::move(d));
  }
  return updates;
}

// The update of each matrix is lr x scale x the same orthogonalized matrix under either
// scaling: Moonlight's 0.2 sqrt(max(rows, cols)), Keller Jordan's sqrt(max(1, rows / cols)).
// The orthogonalized matrix has min(rows, cols) singular values of at most the quintic's
// 1.14, so its RMS is at most 1.14 sqrt(min / (rows cols)); under Moonlight's scale the
// update's RMS over lr lands near AdamW's ~0.2 whatever the shape (the point of it).
TEST(MuonOptimizer, TheUpdateIsScaledAsConfigured) {
  const double lr = 1e-3;
  const auto moonlight = first_updates("moonlight", lr), shape = first_updates("shape", lr);
  Model m(moe_tiny(), tiny_build());
  int checked = 0;
  double rms_sum = 0;
  for (size_t i = 0; i < m.parameters().size(); ++i) {
    const Parameter& p = *m.parameters()[i];
    if (p.role() != ParamRole::matrix && p.role() != ParamRole::expert) continue;
    const double rows = static_cast<double>(p.shape()[0]), cols = static_cast<double>(p.shape()[1]);
    const double ratio = std::sqrt(std::max(1.0, rows / cols)) / (0.2 * std::sqrt(std::max(rows, cols)));
    double sum = 0;
    for (size_t j = 0; j < moonlight[i].size(); ++j) {
      EXPECT_NEAR(shape[i][j], ratio * moonlight[i][j], 1e-12) << p.name() << "[" << j << "]";
      sum += moonlight[i][j] * moonlight[i][j];
    }
    if (sum == 0) continue;  // an expert no token reached: no gradient, no update
    const double rms = std::sqrt(sum / static_cast<double>(moonlight[i].size())) / lr;
    EXPECT_LT(rms, 1.15 * 0.2 * std::sqrt(std::max(rows, cols)) * std::sqrt(std::min(rows, cols) / (rows * cols)))
        << p.name();
    rms_sum += rms;
    ++checked;
  }
  ASSERT_GT(checked, 10);
  const double mean = rms_sum / checked;
  std::printf("Moonlight-scaled first update: mean RMS / lr %.3f over %d matrices\n", mean, checked);
  EXPECT_GT(mean, 0.1);
  EXPECT_LT(mean, 0.23);
}

}  // namespace
}  // namespace kiln

// muP (nn/mup.h, docs/mup.md): the init std of each kind of parameter, the per-group
// learning rates, and the refusal of a tied head. The coordinate check is test_mup_coord.cpp.
#include "grad_check.h"
#include "test_util.h"
#include "tiny_model.h"

#include "config/config.h"
#include "nn/mup.h"
#include "train/optimizer_groups.h"

#include <gtest/gtest.h>

#include <cmath>

namespace kiln {
namespace {

// Width 256 against base 64 (ratio 4), four layers (residual factor 1 / sqrt(8)): dense
// first layer, MoE second, so every role is there.
ModelConfig mup_config(int64_t base) {
  ModelConfig c = test::tiny_config(true, false, 64);
  c.hidden = 256;
  c.layers = 4;
  c.heads = 4;
  c.kv_heads = 2;
  c.head_dim = 64;
  c.ffn_hidden = 512;
  c.init_std = 0.02;
  c.alt_mlp = "moe";
  c.alt_mlp_layers = "1";
  c.moe.experts = 4;
  c.moe.top_k = 2;
  c.moe.expert_hidden = 128;
  c.moe.shared_hidden = 64;
  c.moe.router = "softmax_topk";
  c.mup_base_width = base;
  return c;
}

const Init& init_of(const Model& m, const std::string& name) {
  const Parameter* p = m.find_parameter(name);
  if (p == nullptr) throw std::runtime_error("no parameter " + name);
  return p->init();
}

TEST(Mup, InitStdScalesHiddenMatricesAndResidualWritersZeroesTheHead) {
  const Model m(mup_config(64), test::tiny_build());
  const double hidden = 0.02 / 2, residual = hidden / std::sqrt(8.0);  // 1 / sqrt(256 / 64), 1 / sqrt(2 x 4)
  EXPECT_DOUBLE_EQ(init_of(m, "embed.weight").std, 0.02);               // unscaled
  EXPECT_DOUBLE_EQ(init_of(m, "layers.0.attn.q_proj.weight").std, hidden);
  EXPECT_DOUBLE_EQ(init_of(m, "layers.0.attn.v_proj.weight").std, hidden);
  EXPECT_DOUBLE_EQ(init_of(m, "layers.0.mlp.gate_proj.weight").std, hidden);
  EXPECT_DOUBLE_EQ(init_of(m, "layers.1.mlp.gate.weight").std, hidden);  // the router
  EXPECT_DOUBLE_EQ(init_of(m, "layers.1.mlp.experts.0.up_proj.weight").std, hidden);
  EXPECT_DOUBLE_EQ(init_of(m, "layers.0.attn.o_proj.weight").std, residual);
  EXPECT_DOUBLE_EQ(init_of(m, "layers.0.mlp.down_proj.weight").std, residual);
  EXPECT_DOUBLE_EQ(init_of(m, "layers.1.mlp.experts.3.down_proj.weight").std, residual);
  EXPECT_DOUBLE_EQ(init_of(m, "layers.1.mlp.shared_experts.down_proj.weight").std, residual);
  EXPECT_EQ(init_of(m, "lm_head.weight").kind, InitKind::zeros);
  EXPECT_EQ(init_of(m, "layers.0.attn_norm.weight").kind, InitKind::ones);
}

TEST(Mup, OffKeepsTheStandardInit) {
  const Model m(mup_config(0), test::tiny_build());
  EXPECT_DOUBLE_EQ(init_of(m, "layers.0.attn.q_proj.weight").std, 0.02);
  EXPECT_DOUBLE_EQ(init_of(m, "layers.0.attn.o_proj.weight").std, 0.02 / std::sqrt(8.0));
  EXPECT_EQ(init_of(m, "lm_head.weight").kind, InitKind::normal);
  EXPECT_DOUBLE_EQ(init_of(m, "lm_head.weight").std, 0.02);
}

TEST(Mup, InitializedWeightsHaveTheirStd) {
  ModelConfig c = mup_config(64);
  c.alt_mlp_layers = "";
  Model m(c, test::tiny_build());
  m.allocate();
  m.init_weights(3);
  auto rms = [&](const std::string& name) {
    double s = 0;
    const std::vector<double> v = test::values_of(m.find_parameter(name)->value());
    for (double x : v) s += x * x;
    return std::sqrt(s / static_cast<double>(v.size()));
  };
  EXPECT_NEAR(rms("layers.0.attn.q_proj.weight"), 0.01, 0.0005);
  EXPECT_NEAR(rms("layers.2.mlp.down_proj.weight"), 0.01 / std::sqrt(8.0), 0.0002);
  EXPECT_EQ(rms("lm_head.weight"), 0.0);
}

TEST(Mup, ATiedHeadIsRefusedNamingBothKeys) {
  Config config;
  config.model.mup_base_width = 64;
  config.model.tie_embeddings = true;
  const std::string e = test::error_of([&] { validate_config(config); });
  EXPECT_NE(e.find("model.mup_base_width"), std::string::npos) << e;
  EXPECT_NE(e.find("model.tie_embeddings"), std::string::npos) << e;
  ModelConfig m = mup_config(64);
  m.tie_embeddings = true;
  EXPECT_NE(test::error_of([&] { Model model(m, test::tiny_build()); }).find("model.tie_embeddings"),
            std::string::npos);
}

// AdamW: the roles whose fan-in is the width (head, matrix, expert, router) get B / W;
// embedding, gains and biases keep optim.lr. Groups split by the scale.
TEST(Mup, AdamWLearningRatesOfWidthFanInRolesScaleByBaseOverWidth) {
  const ModelConfig mc = mup_config(64);
  const Model m(mc, test::tiny_build());
  const OptimConfig c;
  const std::vector<OptimizerGroup> groups = group_parameters(c, m.parameters(), mup_width_ratio(mc));
  ASSERT_EQ(groups.size(), 3u);
  EXPECT_EQ(groups[0].roles, (std::vector<ParamRole>{ParamRole::embedding, ParamRole::norm, ParamRole::bias}));
  EXPECT_EQ(groups[0].lr_scale, 1.0);
  EXPECT_EQ(groups[1].roles, (std::vector<ParamRole>{ParamRole::head, ParamRole::matrix, ParamRole::expert}));
  EXPECT_EQ(groups[1].lr_scale, 0.25);
  EXPECT_EQ(groups[2].roles, std::vector<ParamRole>{ParamRole::router});
  EXPECT_EQ(groups[2].lr_scale, 0.25);
  EXPECT_EQ(groups[2].weight_decay, 0.0);
  // The banner shows the rate each group gets.
  const std::vector<std::string> lines = describe_groups(groups, 3e-3);
  EXPECT_NE(lines[1].find("lr 0.00075 (x0.25)"), std::string::npos) << lines[1];
  EXPECT_NE(lines[0].find("lr 0.003 (x1)"), std::string::npos) << lines[0];
}

// Muon's matrices are not scaled (seed 004); the AdamW roles beside them still are, and a
// role's own lr_scale multiplies muP's.
TEST(Mup, MuonMatricesKeepTheirRateAdamWRolesBesideThemScale) {
  const ModelConfig mc = mup_config(64);
  const Model m(mc, test::tiny_build());
  OptimConfig c;
  c.name = "muon";
  c.head.lr_scale = 2;
  const std::vector<OptimizerGroup> groups = group_parameters(c, m.parameters(), mup_width_ratio(mc));
  for (const OptimizerGroup& g : groups) {
    const ParamRole first = g.roles.front();
    const double expected = g.optimizer == "muon" ? 1.0
                            : first == ParamRole::head ? 0.5
                            : mup_scales_role(first) ? 0.25
                                                     : 1.0;
    EXPECT_EQ(g.lr_scale, expected) << g.optimizer << " " << role_name(first);
    if (g.optimizer == "muon") EXPECT_EQ(g.roles, (std::vector<ParamRole>{ParamRole::matrix, ParamRole::expert}));
  }
}

}  // namespace
}  // namespace kiln

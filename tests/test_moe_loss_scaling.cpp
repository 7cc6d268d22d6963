// Dynamic loss scaling with MoE router losses (docs/loss-scaling.md): the balance loss, the
// router z-loss and the relu router's L1 carry the loss scale S in their gradients as the
// LM head's do, so a step at S = 1024 unscales to the gradients of S = 1 (before the fix
// the router losses' were 1 / S too small: 1.02 relative on such a model), and a scaled
// run trains as the unscaled one.
#include "grad_check.h"
#include "tiny_model.h"

#include "config/config.h"
#include "train/optimizer_groups.h"
#include "train/step_program.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <memory>
#include <string>

namespace kiln {
namespace {

// fp64 on the CPU scales by a power of two exactly (the differences come out 0); the bound
// is fp32's rounding, and a router loss without S (off by a large share of the router's
// gradient) is far outside it.
constexpr double kTolerance = 1e-6;

// The tiny model with both MLPs sparse and large router-loss coefficients, so that their
// gradients are a large part of the router's.
ModelConfig softmax_topk(double aux_loss, double z_loss, const std::string& scope = "micro_batch") {
  ModelConfig c = test::tiny_config(true, false);
  c.mlp = "moe";
  c.moe.experts = 4;
  c.moe.top_k = 2;
  c.moe.expert_hidden = 6;
  c.moe.aux_loss = aux_loss;
  c.moe.z_loss = z_loss;
  c.moe.balance_scope = scope;
  return c;
}

// relu (ReMoE) with its L1 coefficient far above the default, so its gradient matters.
ModelConfig relu_router() {
  ModelConfig c = softmax_topk(0, 0);
  c.moe.router = "relu";
  c.moe.l1_coef = 0.05;
  return c;
}

// Four documents as two micro-batches: the router losses' scale holds 1 / micro-batches too.
std::vector<HostBatch> two_micro_batches() {
  std::vector<test::Doc> docs = test::three_docs();
  docs.push_back({{test::kTinyBos, 9, 3, 3, 6, 1}, {9, 3, 3, 6, 1, test::kTinyEos}});
  return {test::pack_docs({docs.begin(), docs.begin() + 2}), test::pack_docs({docs.begin() + 2, docs.end()})};
}

struct Outcome {
  std::vector<double> gradients, weights, losses;
};

// `steps` steps of the two micro-batches at loss scale `scale` (lr 0: the gradients of the
// first step, unscaled by the step; else AdamW's updates), from the same initial weights.
Outcome run(const ModelConfig& config, double scale, int steps, double lr) {
  Model model(config, test::tiny_build());
  Arena state{"optimizer", Device::cpu};
  const std::unique_ptr<Optimizer> optimizer = make_optimizer(model.exec(), OptimConfig{}, model.parameters(), 1.0);
  optimizer->plan(state);
  model.allocate();
  state.allocate();
  test::init_tiny_model(model, 23);
  const std::vector<HostBatch> batches = two_micro_batches();
  model.set_micro_batches(static_cast<int64_t>(batches.size()));
  StepProgram program(model, *optimizer, static_cast<int64_t>(batches.size()), StepExecution::op_by_op);
  StepPlan plan;
  plan.lr = lr;
  plan.loss_limit = plan.grad_limit = std::numeric_limits<double>::infinity();
  plan.loss_scale = scale;
  Outcome out;
  for (int step = 0; step < steps; ++step) {
    const StepOutcome o = program.run(batches, batches[0].target_count + batches[1].target_count, plan);
    EXPECT_EQ(o.verdict, ops::StepVerdict::apply);
    out.losses.push_back(o.loss);
    if (step == 0)
      for (const auto& p : model.parameters())
        if (p->trainable())
          out.gradients.insert(out.gradients.end(), p->grad().data<double>(), p->grad().data<double>() + p->grad().numel());
  }
  for (const auto& p : model.parameters())  // relu's L1 coefficient too
    out.weights.insert(out.weights.end(), p->value().data<double>(), p->value().data<double>() + p->value().numel());
  return out;
}

struct Case {
  std::string name;
  ModelConfig config;
};

std::vector<Case> cases() {
  return {{"balance loss", softmax_topk(0.5, 0)},
          {"router z-loss", softmax_topk(0, 0.2)},
          {"both, balance_scope = step", softmax_topk(0.5, 0.2, "step")},
          {"relu's L1", relu_router()}};
}

TEST(MoeLossScaling, RouterLossGradientsAtScale1024UnscaleToScale1s) {
  for (const Case& c : cases()) {
    const Outcome plain = run(c.config, 1, 1, 0), scaled = run(c.config, 1024, 1, 0);
    const double d = test::max_diff_over_max(scaled.gradients, plain.gradients);
    EXPECT_LE(d, kTolerance) << c.name;
    std::printf("%s: max relative difference %.3g\n", c.name.c_str(), d);
  }
}

// The checks here can fail: the router losses' gradients are a large part of the whole.
// A loss that lost S keeps 1 / 1024 of its gradient after the unscaling, nearly the model
// without it, whose gradients differ from the model's with it by far more than the bound.
TEST(MoeLossScaling, RouterLossGradientsAreALargePartOfTheGradients) {
  for (const Case& c : cases()) {
    ModelConfig without = c.config;
    without.moe.aux_loss = without.moe.z_loss = 0;
    without.moe.balance_scope = "micro_batch";
    if (without.moe.router == "relu") without.moe.l1_coef = 0;
    const double d = test::max_diff_over_max(run(without, 1, 1, 0).gradients, run(c.config, 1, 1, 0).gradients);
    EXPECT_GT(d, 1e-3) << c.name;
  }
}

// Three AdamW steps at S = 1024 give the unscaled run's losses and weights.
TEST(MoeLossScaling, ScaledStepsTrainAsUnscaledOnes) {
  for (const Case& c : cases()) {
    const Outcome plain = run(c.config, 1, 3, 1e-2), scaled = run(c.config, 1024, 3, 1e-2);
    EXPECT_LE(test::max_diff_over_max(scaled.losses, plain.losses), kTolerance) << c.name;
    EXPECT_LE(test::max_diff_over_max(scaled.weights, plain.weights), kTolerance) << c.name;
  }
}

// train.loss_scale = "dynamic" is accepted with every router loss now.
TEST(MoeLossScaling, DynamicLossScaleWithRouterLossesIsAccepted) {
  for (const std::vector<std::string> overrides :
       {std::vector<std::string>{"model.moe.aux_loss=0.01", "model.moe.z_loss=0.001"},
        std::vector<std::string>{"model.moe.router=relu", "model.moe.aux_loss=0"}}) {
    Config config;
    for (const std::string& o : overrides) apply_override(config, o);
    apply_override(config, "model.mlp=moe");
    apply_override(config, "train.loss_scale=dynamic");
    EXPECT_NO_THROW(validate_config(config)) << overrides[0];
  }
}

}  // namespace
}  // namespace kiln

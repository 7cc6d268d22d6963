// The balance loss over the whole step (model.moe.balance_scope = "step"; nn/moe/moe_mlp.cpp):
// one step's gradient and balance-loss value do not depend on how its tokens are split into
// micro-batches or over data-parallel ranks. The reference is the whole batch as one
// micro-batch under the default scope (one micro-batch is the whole step), through the
// per-micro-batch ops (ops::balance_loss), not the step-scope code.
//
// Not bitwise: the step's probabilities and gradients are summed in another order (per
// micro-batch, then across micro-batches and ranks), so in fp64 they agree to ~1e-15; the
// tolerance is 1e-10 relative to each gradient's largest element.
#include "tiny_model.h"

#include "config/config.h"
#include "dist/free_port.h"
#include "dist/process_group.h"
#include "thread_ranks.h"
#include "train/data_parallel.h"
#include "train/optimizer_groups.h"
#include "train/step_program.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <limits>
#include <memory>
#include <string>

namespace kiln {
namespace {

using namespace std::chrono_literals;

constexpr double kTolerance = 1e-10;

// The tiny model with both MLPs sparse and large balance and z-loss coefficients, so that
// their gradients are a large part of the router's.
ModelConfig moe_config(const std::string& scope) {
  ModelConfig c = test::tiny_config(true, false);
  c.mlp = "moe";
  c.moe.experts = 4;
  c.moe.top_k = 2;
  c.moe.expert_hidden = 6;
  c.moe.aux_loss = 0.5;
  c.moe.z_loss = 0.2;
  c.moe.balance_scope = scope;
  return c;
}

// A model and its optimizer (applied only where a plan's lr is not 0), initialized the same
// way every time.
struct MoeRun {
  Model model;
  Arena state{"optimizer", Device::cpu};
  std::unique_ptr<Optimizer> optimizer;

  explicit MoeRun(const std::string& scope, int64_t micro_batches_per_step) : MoeRun(moe_config(scope), micro_batches_per_step) {}
  MoeRun(const ModelConfig& config, int64_t micro_batches_per_step, const BuildOptions& build = test::tiny_build())
      : model(config, build) {
    optimizer = make_optimizer(model.exec(), OptimConfig{}, model.parameters(), 1.0);
    optimizer->plan(state);
    model.allocate();
    state.allocate();
    test::init_tiny_model(model, 23);
    model.set_micro_batches(micro_batches_per_step);
  }

  std::vector<double> gradients() const {
    std::vector<double> out;
    for (const auto& p : model.parameters()) {
      const double* g = p->grad().data<double>();
      out.insert(out.end(), g, g + p->grad().numel());
    }
    return out;
  }
  std::vector<double> weights() const {
    std::vector<double> out;
    for (const auto& p : model.parameters()) {
      const double* w = p->value().data<double>();
      out.insert(out.end(), w, w + p->value().numel());
    }
    return out;
  }
  double balance_loss(const StepOutcome& o, int64_t targets, int64_t micro_batches) const {
    return model.loss_terms().value(model.loss_terms().find("moe_aux"), o.step_sums, targets, micro_batches);
  }
  double z_loss(const StepOutcome& o, int64_t targets, int64_t micro_batches) const {
    return model.loss_terms().value(model.loss_terms().find("moe_z"), o.step_sums, targets, micro_batches);
  }
};

// Four documents of awkward lengths (5, 7, 4, 6): 22 tokens, one micro-batch of 24 at most.
std::vector<test::Doc> four_docs() {
  std::vector<test::Doc> docs = test::three_docs();
  docs.push_back({{test::kTinyBos, 9, 3, 3, 6, 1}, {9, 3, 3, 6, 1, test::kTinyEos}});
  return docs;
}

// The four documents as `parts` micro-batches (1, 2 or 4), in order.
std::vector<HostBatch> split(int parts) {
  const std::vector<test::Doc> docs = four_docs();
  std::vector<HostBatch> out;
  const size_t per = docs.size() / static_cast<size_t>(parts);
  for (size_t i = 0; i < docs.size(); i += per) out.push_back(test::pack_docs({docs.begin() + i, docs.begin() + i + per}));
  return out;
}

int64_t targets_of(const std::vector<HostBatch>& batches) {
  int64_t n = 0;
  for (const HostBatch& b : batches) n += b.target_count;
  return n;
}

StepPlan frozen() {
  StepPlan plan;
  plan.lr = 0;
  plan.loss_limit = plan.grad_limit = std::numeric_limits<double>::infinity();
  return plan;
}

// max |a - b| relative to max |b|.
double difference(const std::vector<double>& a, const std::vector<double>& b) {
  EXPECT_EQ(a.size(), b.size());
  double diff = 0, scale = 1e-300;
  for (size_t i = 0; i < a.size(); ++i) diff = std::max(diff, std::abs(a[i] - b[i])), scale = std::max(scale, std::abs(b[i]));
  return diff / scale;
}

struct Reference {
  std::vector<double> gradients;
  double balance_loss = 0, z_loss = 0, loss = 0;
};

// The whole batch as one micro-batch, default scope.
Reference whole_batch() {
  MoeRun run("micro_batch", 1);
  const std::vector<HostBatch> batches = split(1);
  StepProgram program(run.model, *run.optimizer, 1, StepExecution::op_by_op);
  const StepOutcome o = program.run(batches, targets_of(batches), frozen());
  return {run.gradients(), run.balance_loss(o, targets_of(batches), 1), run.z_loss(o, targets_of(batches), 1), o.loss};
}

TEST(MoeStepBalance, GradAccumOneTwoAndFourGiveTheWholeBatchsStep) {
  const Reference ref = whole_batch();
  ASSERT_GT(ref.balance_loss, 0.0);
  for (int parts : {1, 2, 4}) {
    SCOPED_TRACE(::testing::Message() << "grad_accum " << parts);
    MoeRun run("step", parts);
    const std::vector<HostBatch> batches = split(parts);
    ASSERT_EQ(batches.size(), static_cast<size_t>(parts));
    StepProgram program(run.model, *run.optimizer, parts, StepExecution::op_by_op);
    const StepOutcome o = program.run(batches, targets_of(batches), frozen());
    EXPECT_NEAR(run.balance_loss(o, targets_of(batches), parts), ref.balance_loss, kTolerance * ref.balance_loss);
    EXPECT_NEAR(run.z_loss(o, targets_of(batches), parts), ref.z_loss, kTolerance * ref.z_loss);
    EXPECT_NEAR(o.loss, ref.loss, kTolerance * ref.loss);
    const double d = difference(run.gradients(), ref.gradients);
    RecordProperty(fmt::format("gradient_relative_difference_{}", parts), fmt::format("{:.3g}", d));
    EXPECT_LE(d, kTolerance);
  }
}

// The default scope averages the micro-batches' own losses: another value and gradient at
// grad_accum 2, which is what the step scope is for (and what makes the test above able to fail).
TEST(MoeStepBalance, TheMicroBatchScopeDiffersAtGradAccumTwo) {
  const Reference ref = whole_batch();
  MoeRun run("micro_batch", 2);
  const std::vector<HostBatch> batches = split(2);
  StepProgram program(run.model, *run.optimizer, 2, StepExecution::op_by_op);
  const StepOutcome o = program.run(batches, targets_of(batches), frozen());
  EXPECT_GT(std::abs(run.balance_loss(o, targets_of(batches), 2) - ref.balance_loss), 1e-4 * ref.balance_loss);
  // The halves hold different numbers of rows: the mean of their z-loss means is not the
  // step's mean.
  EXPECT_GT(std::abs(run.z_loss(o, targets_of(batches), 2) - ref.z_loss), 1e-6 * ref.z_loss);
  const double d = difference(run.gradients(), ref.gradients);
  RecordProperty("gradient_relative_difference", fmt::format("{:.3g}", d));
  EXPECT_GT(d, 1e-6);
}

// Two Gloo ranks (threads), each with half the documents as its `accum` micro-batches (one
// each, or two each): the counts summed over the ranks before backward give the whole
// batch's step on both.
void expect_two_ranks_give_the_whole_batchs_step(int accum) {
  const Reference ref = whole_batch();
  const int world = 2, port = dist::free_loopback_port();
  const std::vector<HostBatch> parts = split(world * accum);
  const int64_t targets = targets_of(parts);
  std::vector<std::vector<double>> gradients(world);
  std::vector<double> balance(world), z(world), loss(world);
  const std::vector<std::string> errors = test::run_ranks(world, [&](int r) {
    dist::ProcessGroup group(test::placement(r, world, port), Device::cpu, 20000ms);
    MoeRun run("step", world * accum);
    DataParallel data_parallel(group, run.model, DataParallelOptions{});
    StepProgram program(run.model, *run.optimizer, accum, StepExecution::op_by_op, &data_parallel);
    const std::vector<HostBatch> mine(parts.begin() + r * accum, parts.begin() + (r + 1) * accum);
    const StepOutcome o = program.run(mine, targets, frozen());
    gradients[static_cast<size_t>(r)] = run.gradients();
    balance[static_cast<size_t>(r)] = run.balance_loss(o, targets, world * accum);
    z[static_cast<size_t>(r)] = run.z_loss(o, targets, world * accum);
    loss[static_cast<size_t>(r)] = o.loss;
  });
  for (int r = 0; r < world; ++r) {
    SCOPED_TRACE(::testing::Message() << "rank " << r << ", grad_accum " << accum);
    ASSERT_EQ(errors[static_cast<size_t>(r)], "");
    EXPECT_NEAR(balance[static_cast<size_t>(r)], ref.balance_loss, kTolerance * ref.balance_loss);
    EXPECT_NEAR(z[static_cast<size_t>(r)], ref.z_loss, kTolerance * ref.z_loss);
    EXPECT_NEAR(loss[static_cast<size_t>(r)], ref.loss, kTolerance * ref.loss);
    const double d = difference(gradients[static_cast<size_t>(r)], ref.gradients);
    ::testing::Test::RecordProperty(fmt::format("gradient_relative_difference_rank_{}_accum_{}", r, accum), fmt::format("{:.3g}", d));
    EXPECT_LE(d, kTolerance);
  }
}

TEST(MoeStepBalance, TwoRanksGiveTheWholeBatchsStep) { expect_two_ranks_give_the_whole_batchs_step(1); }
TEST(MoeStepBalance, TwoRanksOfTwoMicroBatchesGiveTheWholeBatchsStep) { expect_two_ranks_give_the_whole_batchs_step(2); }

// Three applied AdamW steps (lr 0.02, no clip): the weights after them, and each step's
// balance loss, at grad_accum 2 and 4 are the whole batch's at grad_accum 1. Each step
// counts its own routes with the weights the last update left (stale counts would not pass).
TEST(MoeStepBalance, ThreeStepsAtGradAccumTwoAndFourTrainTheWholeBatchsWeights) {
  constexpr int kSteps = 3;
  StepPlan plan = frozen();
  plan.lr = 0.02;
  auto train = [&](const std::string& scope, int parts, std::vector<double>& balance) {
    MoeRun run(scope, parts);
    const std::vector<HostBatch> batches = split(parts);
    StepProgram program(run.model, *run.optimizer, parts, StepExecution::op_by_op);
    for (int s = 0; s < kSteps; ++s) {
      const StepOutcome o = program.run(batches, targets_of(batches), plan);
      EXPECT_TRUE(o.applied());
      balance.push_back(run.balance_loss(o, targets_of(batches), parts));
    }
    return run.weights();
  };
  std::vector<double> ref_balance;
  const std::vector<double> ref = train("micro_batch", 1, ref_balance);
  MoeRun initial("micro_batch", 1);
  ASSERT_GT(difference(ref, initial.weights()), 1e-3);  // the steps moved the weights
  ASSERT_GT(std::abs(ref_balance.back() - ref_balance.front()), 1e-6 * ref_balance.front());  // and the routing
  for (int parts : {2, 4}) {
    SCOPED_TRACE(::testing::Message() << "grad_accum " << parts);
    std::vector<double> balance;
    const double d = difference(train("step", parts, balance), ref);
    RecordProperty(fmt::format("weight_relative_difference_{}", parts), fmt::format("{:.3g}", d));
    EXPECT_LE(d, kTolerance);
    for (int s = 0; s < kSteps; ++s)
      EXPECT_NEAR(balance[static_cast<size_t>(s)], ref_balance[static_cast<size_t>(s)], kTolerance * ref_balance[static_cast<size_t>(s)]);
  }
}

// At grad_accum 1 the step is the micro-batch, so the scopes agree -- also with dropout, a
// recomputed block, a capacity, and sinkhorn (whose training route differs from its
// evaluation one): the counting pass must route exactly as the training pass (the batch's
// dropout key, the training route), and the recomputed forward must not count again.
TEST(MoeStepBalance, AtGradAccumOneTheScopesAgreeWithDropoutRecomputeAndTrainingRoutes) {
  for (const std::string router : {"softmax_topk", "sinkhorn"}) {
    SCOPED_TRACE(router);
    auto step = [&](const std::string& scope) {
      ModelConfig c = moe_config(scope);
      c.dropout = 0.3;
      c.moe.capacity_factor = 1.0;
      c.moe.router = router;
      BuildOptions build = test::tiny_build();
      build.recompute_blocks = 1;
      MoeRun run(c, 1, build);
      std::vector<HostBatch> batches = split(1);
      batches[0].dropout_key = 0x1234abcdull;
      StepProgram program(run.model, *run.optimizer, 1, StepExecution::op_by_op);
      const StepOutcome o = program.run(batches, targets_of(batches), frozen());
      return Reference{run.gradients(), run.balance_loss(o, targets_of(batches), 1), run.z_loss(o, targets_of(batches), 1),
                       o.loss};
    };
    const Reference ref = step("micro_batch"), got = step("step");
    EXPECT_NEAR(got.balance_loss, ref.balance_loss, kTolerance * ref.balance_loss);
    EXPECT_NEAR(got.z_loss, ref.z_loss, kTolerance * ref.z_loss);
    EXPECT_NEAR(got.loss, ref.loss, kTolerance * ref.loss);
    const double d = difference(got.gradients, ref.gradients);
    RecordProperty("gradient_relative_difference_" + router, fmt::format("{:.3g}", d));
    EXPECT_LE(d, kTolerance);
  }
}

// The message validate_config refuses `overrides` with ("" if it accepts them).
std::string refusal(const std::vector<std::string>& overrides) {
  Config config;
  try {
    for (const std::string& o : overrides) apply_override(config, o);
    validate_config(config);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

TEST(MoeStepBalance, BadSettingsAreRefusedByName) {
  const std::string moe = "model.mlp=moe";
  EXPECT_EQ(refusal({moe, "model.moe.aux_loss=0.01", "model.moe.balance_scope=step"}), "");
  const std::string unknown = refusal({moe, "model.moe.aux_loss=0.01", "model.moe.balance_scope=batch"});
  EXPECT_NE(unknown.find("model.moe.balance_scope"), std::string::npos) << unknown;
  const std::string no_loss = refusal({moe, "model.moe.balance_scope=step"});
  EXPECT_NE(no_loss.find("model.moe.balance_scope"), std::string::npos) << no_loss;
}

}  // namespace
}  // namespace kiln

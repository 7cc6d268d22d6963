// The step program (train/step_program.h) on the CPU: its op-by-op execution is the loop it
// replaced, bit for bit; a verdict that skips leaves weights and the update count alone;
// what it cannot run it refuses by name.
#include "tiny_model.h"

#include "config/config.h"
#include "core/error.h"
#include "train/optimizer_groups.h"
#include "train/step_program.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <memory>

namespace kiln {
namespace {

constexpr double kLr = 3e-2;

// A tiny f64 model and its AdamW, both initialized the same way every time.
struct TinyRun {
  Model model{test::tiny_config(true, false), test::tiny_build()};
  Arena state{"optimizer", Device::cpu};
  std::unique_ptr<Optimizer> optimizer;

  TinyRun() {
    OptimConfig oc;
    optimizer = make_optimizer(model.exec(), oc, model.parameters(), 1.0);
    optimizer->plan(state);
    model.allocate();
    state.allocate();
    test::init_tiny_model(model, 11);
  }

  std::vector<double> weights() const {
    std::vector<double> out;
    for (const auto& p : model.parameters()) {
      const double* v = p->value().data<double>();
      out.insert(out.end(), v, v + p->value().numel());
    }
    return out;
  }
};

// Two micro-batches of different documents.
std::vector<HostBatch> two_micro_batches() {
  const std::vector<test::Doc> docs = test::three_docs();
  return {test::pack_docs({docs[0], docs[1]}), test::pack_docs({docs[2]})};
}

int64_t targets_of(const std::vector<HostBatch>& batches) {
  int64_t n = 0;
  for (const HostBatch& b : batches) n += b.target_count;
  return n;
}

StepPlan plan_without_limits(double clip) {
  StepPlan plan;
  plan.lr = kLr;
  plan.loss_limit = plan.grad_limit = std::numeric_limits<double>::infinity();
  plan.clip = clip;
  return plan;
}

TEST(StepProgram, OpByOpIsTheLoopItReplacedBitForBit) {
  const std::vector<HostBatch> batches = two_micro_batches();
  const int64_t targets = targets_of(batches);
  const double clip = 0.05;  // below the tiny model's norm: the clip applies

  TinyRun by_hand;
  double hand_loss = 0, hand_norm = 0;
  for (int step = 0; step < 3; ++step) {  // the trainer's host loop before the step program
    by_hand.model.zero_grads();
    double sum = 0;
    for (const HostBatch& b : batches) {
      by_hand.model.load_batch(b);
      sum += by_hand.model.forward_backward(1.0 / static_cast<double>(targets)).loss;
    }
    hand_loss = sum / static_cast<double>(targets);
    hand_norm = by_hand.model.gradient_norm();
    ASSERT_TRUE(ops::clip_applies(clip, hand_norm));
    by_hand.model.scale_gradients(ops::clip_factor(clip, hand_norm));
    by_hand.optimizer->step(kLr);
    by_hand.model.after_step(true);
  }

  TinyRun program_run;
  StepProgram program(program_run.model, *program_run.optimizer, 2, StepExecution::op_by_op);
  StepOutcome outcome;
  for (int step = 0; step < 3; ++step) outcome = program.run(batches, targets, plan_without_limits(clip));

  EXPECT_TRUE(outcome.applied());
  EXPECT_EQ(outcome.loss, hand_loss);
  EXPECT_EQ(outcome.grad_norm, hand_norm);
  EXPECT_EQ(outcome.step_sums[0], hand_loss * static_cast<double>(targets));
  EXPECT_EQ(program_run.optimizer->steps_taken(), 3);
  EXPECT_EQ(program_run.weights(), by_hand.weights());
  EXPECT_EQ(program.graph_launches(), 0);
}

TEST(StepProgram, ASkippingVerdictLeavesWeightsAndTheUpdateCountAlone) {
  const std::vector<HostBatch> batches = two_micro_batches();
  const int64_t targets = targets_of(batches);
  TinyRun run;
  StepProgram program(run.model, *run.optimizer, 2, StepExecution::op_by_op);
  const std::vector<double> before = run.weights();

  // A non-finite loss (the test fault hook's), then a loss spike (a limit below the loss).
  program.set_fault_hook([](double& loss) { loss = std::nan(""); });
  StepOutcome outcome = program.run(batches, targets, plan_without_limits(0));
  EXPECT_EQ(outcome.verdict, ops::StepVerdict::non_finite_loss);
  program.set_fault_hook(nullptr);
  StepPlan spiking = plan_without_limits(0);
  spiking.loss_limit = 1e-3;
  outcome = program.run(batches, targets, spiking);
  EXPECT_EQ(outcome.verdict, ops::StepVerdict::loss_spike);
  EXPECT_GT(outcome.loss, 1e-3);
  EXPECT_EQ(run.weights(), before);
  EXPECT_EQ(run.optimizer->steps_taken(), 0);

  outcome = program.run(batches, targets, plan_without_limits(0));
  EXPECT_TRUE(outcome.applied());
  EXPECT_NE(run.weights(), before);
  EXPECT_EQ(run.optimizer->steps_taken(), 1);
}

TEST(StepProgram, RefusesWhatItCannotRunByName) {
  TinyRun run;
  EXPECT_EQ(choose_step_execution(Device::cpu, true, *run.optimizer), StepExecution::op_by_op);
  StepProgram program(run.model, *run.optimizer, 2, StepExecution::op_by_op);
  const std::vector<HostBatch> one = {two_micro_batches()[0]};
  try {
    program.run(one, one[0].target_count, plan_without_limits(0));
    FAIL() << "a step of the wrong micro-batch count ran";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("1 micro-batches for a step planned with 2"), std::string::npos) << e.what();
  }
  // The captured step needs a GPU model (and a CUDA build).
  try {
    StepProgram captured(run.model, *run.optimizer, 1, StepExecution::captured);
    FAIL() << "a captured step was made for a CPU model";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("captured step needs"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace kiln

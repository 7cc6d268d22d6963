// Learning-rate schedules (train/schedules.h): each one's warmup, its shape at the points
// where the formula gives an exact value, where it ends, and that wsd retargets when a
// resumed run asks for more steps. Plus the config's refusal of an unknown decay shape.
#include "config/config.h"
#include "fault_test_util.h"
#include "test_util.h"
#include "train/schedules.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>

namespace kiln {
namespace {

constexpr double kLr = 1e-2, kMin = 0.1;

OptimConfig optim(const std::string& schedule, int64_t warmup = 10) {
  OptimConfig c;
  c.schedule = schedule;
  c.lr = kLr;
  c.min_lr_ratio = kMin;
  c.warmup_steps = warmup;
  return c;
}

std::unique_ptr<Schedule> build(const OptimConfig& c, int64_t total) {
  return schedule_registry().build("optim.schedule", c.schedule, c, total);
}

// lr * min + (lr - lr * min) * f
double at(double f) { return kLr * (kMin + (1.0 - kMin) * f); }

TEST(Schedules, EveryScheduleWarmsUpLinearlyToThePeak) {
  for (const char* name : {"cosine", "linear", "constant", "wsd"}) {
    SCOPED_TRACE(name);
    const auto s = build(optim(name), 100);
    for (int64_t step = 0; step < 10; ++step) EXPECT_DOUBLE_EQ(s->lr(step), kLr * static_cast<double>(step + 1) / 10);
    EXPECT_DOUBLE_EQ(s->lr(10), kLr);  // the first step after warmup is at the peak
  }
}

TEST(Schedules, CosineAndLinearEndAtTheFloorThroughTheirMidpoints) {
  // 10 warmup steps, then steps 10 .. 90: 80 intervals, the midpoint at 50, a quarter at 30.
  const auto cosine = build(optim("cosine"), 91), linear = build(optim("linear"), 91);
  EXPECT_DOUBLE_EQ(cosine->lr(90), at(0.0));
  EXPECT_DOUBLE_EQ(linear->lr(90), at(0.0));
  EXPECT_NEAR(cosine->lr(50), at(0.5), 1e-15);
  EXPECT_NEAR(linear->lr(50), at(0.5), 1e-15);
  EXPECT_NEAR(cosine->lr(30), at(0.5 * (1 + std::cos(M_PI / 4))), 1e-15);
  EXPECT_NEAR(linear->lr(30), at(0.75), 1e-15);
  for (int64_t step = 11; step <= 90; ++step) EXPECT_LT(linear->lr(step), linear->lr(step - 1)) << step;
}

TEST(Schedules, ConstantHoldsThePeak) {
  const auto s = build(optim("constant"), 50);
  for (int64_t step = 10; step < 50; ++step) EXPECT_EQ(s->lr(step), kLr);
}

TEST(Schedules, WsdHoldsThePeakThenDecaysInEachShapeToTheFloor) {
  for (const char* shape : {"linear", "cosine", "1-sqrt"}) {
    SCOPED_TRACE(shape);
    OptimConfig c = optim("wsd");
    c.decay_shape = shape;
    c.decay_fraction = 0.2;  // 20 of 100 steps: the tail is steps 80 .. 99
    const auto s = build(c, 100);
    for (int64_t step = 10; step <= 80; ++step) EXPECT_EQ(s->lr(step), kLr) << step;  // stable (80: p = 0)
    EXPECT_DOUBLE_EQ(s->lr(99), at(0.0));
    // Steps 80 .. 99 span 19 intervals: p = (step - 80) / 19.
    const double p = 5.0 / 19.0;
    const double f = std::string(shape) == "linear" ? 1 - p : std::string(shape) == "cosine" ? 0.5 * (1 + std::cos(M_PI * p))
                                                                                           : 1 - std::sqrt(p);
    EXPECT_NEAR(s->lr(85), at(f), 1e-15);
    for (int64_t step = 81; step < 100; ++step) EXPECT_LT(s->lr(step), s->lr(step - 1)) << step;
  }
}

TEST(Schedules, WsdDecayStepsOverrideTheFractionAndAreClampedToTheRun) {
  OptimConfig c = optim("wsd");
  c.decay_steps = 5;
  const auto s = build(c, 100);
  EXPECT_EQ(s->lr(95), kLr);  // the tail is steps 95 .. 99
  EXPECT_LT(s->lr(96), kLr);
  EXPECT_DOUBLE_EQ(s->lr(99), at(0.0));
  // A tail longer than the steps after warmup starts right after warmup.
  c.decay_steps = 1000;
  const auto all = build(c, 100);
  EXPECT_EQ(all->lr(10), kLr);
  EXPECT_LT(all->lr(11), kLr);
  EXPECT_DOUBLE_EQ(all->lr(99), at(0.0));
  // No tail at all: the peak to the end.
  c.decay_steps = 0, c.decay_fraction = 0;
  const auto none = build(c, 100);
  EXPECT_EQ(none->lr(99), kLr);
}

// Warmup and the wsd tail in tokens: rounded up to whole steps of the given size, in place
// of warmup_steps and decay_steps, so the same token counts hold when the batch changes.
TEST(Schedules, WarmupAndDecayInTokensBecomeWholeSteps) {
  OptimConfig tokens = optim("wsd", 50);  // warmup_steps 50, ignored below
  tokens.warmup_tokens = 10 * 4096 + 1;   // 11 steps of 4096 tokens
  tokens.decay_tokens = 20 * 4096;        // 20 steps
  OptimConfig steps = optim("wsd", 11);
  steps.decay_steps = 20;
  const auto by_tokens = make_schedule(tokens, 100, 4096), by_steps = build(steps, 100);
  for (int64_t i = 0; i < 100; ++i) EXPECT_EQ(by_tokens->lr(i), by_steps->lr(i)) << "step " << i;
  // Twice the tokens per step: half the steps (rounded up).
  steps.warmup_steps = 6, steps.decay_steps = 10;
  const auto big_batch = make_schedule(tokens, 100, 8192), by_half = build(steps, 100);
  for (int64_t i = 0; i < 100; ++i) EXPECT_EQ(big_batch->lr(i), by_half->lr(i)) << "step " << i;
  // Zero tokens: the steps as given.
  const auto plain = make_schedule(optim("cosine", 7), 100, 4096), plain_steps = build(optim("cosine", 7), 100);
  for (int64_t i = 0; i < 100; ++i) EXPECT_EQ(plain->lr(i), plain_steps->lr(i));
}

// A run resumed with more steps continues in the stable phase: the two runs agree on every
// step before the shorter one's tail, and the longer one decays at its own end.
TEST(Schedules, WsdRetargetsWhenAResumedRunAsksForMoreSteps) {
  OptimConfig c = optim("wsd");
  c.decay_steps = 20;
  const auto first = build(c, 100), longer = build(c, 300);
  for (int64_t step = 0; step <= 80; ++step) EXPECT_EQ(first->lr(step), longer->lr(step)) << step;
  EXPECT_EQ(longer->lr(99), kLr);
  EXPECT_DOUBLE_EQ(longer->lr(299), at(0.0));
}

TEST(Schedules, AnUnknownDecayShapeIsRefusedNamingTheKey) {
  Config c;
  apply_override(c, "optim.decay_shape=sqrt");
  const std::string error = test::error_of([&] { validate_config(c); });
  EXPECT_NE(error.find("optim.decay_shape"), std::string::npos) << error;
  apply_override(c, "optim.decay_shape=1-sqrt");
  EXPECT_NO_THROW(validate_config(c));
}

// The learning rate of each logged step of a run (metrics.jsonl).
std::map<int64_t, double> logged_lr(const std::string& out_dir) {
  std::map<int64_t, double> lr;
  std::ifstream in(out_dir + "/metrics.jsonl");
  std::string line;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    if (j["kind"] == "train") lr[j["step"].get<int64_t>()] = j["lr"].get<double>();
  }
  return lr;
}

// Through `kiln train`: 12 steps of wsd with a 4-step tail, then the run resumed from its
// step-8 checkpoint with train.steps = 20: steps 9 .. 16 stay at the peak (the first run
// was decaying there) and the new tail ends at the floor.
TEST(Schedules, AResumedWsdRunWithMoreStepsContinuesStableAndDecaysAtItsNewEnd) {
  const std::string dir = test::temp_dir("kiln-schedules");
  const std::string corpus = test::write_tiny_corpus(dir, 40);
  const std::string wsd = "--set optim.schedule=wsd --set optim.decay_steps=4 ";
  std::string output;
  ASSERT_EQ(test::run_with_fault(test::tiny_train(corpus, dir + "/first", wsd), "", &output), 0) << output;
  const std::map<int64_t, double> first = logged_lr(dir + "/first");
  ASSERT_EQ(first.size(), 12u) << output;
  for (int64_t step = 4; step <= 9; ++step) EXPECT_DOUBLE_EQ(first.at(step), 1e-2) << step;  // the tail: 9 .. 12
  EXPECT_LT(first.at(10), 1e-2);
  EXPECT_DOUBLE_EQ(first.at(12), 1e-3);

  ASSERT_EQ(test::run_with_fault(test::tiny_train(corpus, dir + "/longer",
                                                  wsd + "--set train.steps=20 --resume " +
                                                      test::checkpoint_path(dir + "/first", 8)),
                                 "", &output),
            0)
      << output;
  const std::map<int64_t, double> longer = logged_lr(dir + "/longer");
  ASSERT_EQ(longer.size(), 12u) << output;  // steps 9 .. 20
  for (int64_t step = 9; step <= 17; ++step) EXPECT_DOUBLE_EQ(longer.at(step), 1e-2) << step;
  EXPECT_LT(longer.at(18), 1e-2);
  EXPECT_DOUBLE_EQ(longer.at(20), 1e-3);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kiln

// The training loop's schedule of periodic actions (train/action_schedule.h): when each
// cadence is due, the order actions run in, and the last step left to the end of the run.
#include "train/action_schedule.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace kiln {
namespace {

// Steps 1..last of `tokens_per_step` tokens each: the steps at which `cadence` is due.
std::vector<int64_t> due_steps(const Cadence& cadence, int64_t last, int64_t tokens_per_step) {
  std::vector<int64_t> out;
  for (int64_t step = 1; step <= last; ++step)
    if (cadence.due({step, last, (step - 1) * tokens_per_step, step * tokens_per_step})) out.push_back(step);
  return out;
}

TEST(ActionSchedule, CadencesAreDueByStepsOrByTokensCrossed) {
  EXPECT_EQ(due_steps({3, 0}, 10, 100), (std::vector<int64_t>{3, 6, 9}));
  // 250 tokens at 100 per step: crossed during steps 3 (300), 5 (500), 8 (800).
  EXPECT_EQ(due_steps({0, 250}, 9, 100), (std::vector<int64_t>{3, 5, 8}));
  // Either measure: the union, each step once.
  EXPECT_EQ(due_steps({4, 250}, 9, 100), (std::vector<int64_t>{3, 4, 5, 8}));
  EXPECT_TRUE(due_steps({0, 0}, 9, 100).empty());
}

TEST(ActionSchedule, TheLastStepRunsOnlyWhatAsksForIt) {
  EXPECT_EQ(due_steps({3, 0}, 9, 100), (std::vector<int64_t>{3, 6}));           // 9 is the end's
  EXPECT_EQ(due_steps({3, 0, true}, 8, 100), (std::vector<int64_t>{3, 6, 8}));  // the log: also the last
  EXPECT_EQ(due_steps({0, 0, true}, 4, 100), (std::vector<int64_t>{4}));
}

TEST(ActionSchedule, CrossedCountsTheLastStepForTheEndOfTheRun) {
  const Cadence by_tokens{0, 300};
  const StepSpan before_600{4, 6, 300, 400}, last_to_600{6, 6, 500, 600};
  EXPECT_FALSE(by_tokens.crossed(before_600));
  EXPECT_TRUE(by_tokens.crossed(last_to_600));  // 600 crossed by the last step ...
  EXPECT_FALSE(by_tokens.due(last_to_600));     // ... which the schedule leaves to the end
  EXPECT_TRUE((Cadence{3, 0}.crossed(last_to_600)));
  EXPECT_FALSE((Cadence{4, 0}.crossed(last_to_600)));
}

TEST(ActionSchedule, DueActionsRunInTheOrderAdded) {
  std::vector<std::string> ran;
  ActionSchedule schedule;
  schedule.add("log", {1, 0, true}, [&](const StepSpan& s) { ran.push_back("log " + std::to_string(s.step)); });
  schedule.add("validation", {2, 0}, [&](const StepSpan& s) { ran.push_back("val " + std::to_string(s.step)); });
  schedule.add("never", {0, 0}, [&](const StepSpan&) { ran.push_back("never"); });
  schedule.add("checkpoint", {0, 150}, [&](const StepSpan& s) { ran.push_back("ckpt " + std::to_string(s.step)); });
  for (int64_t step = 1; step <= 4; ++step) schedule.run_due({step, 4, (step - 1) * 100, step * 100});
  EXPECT_EQ(ran, (std::vector<std::string>{"log 1", "log 2", "val 2", "ckpt 2", "log 3", "ckpt 3", "log 4"}));
}

}  // namespace
}  // namespace kiln

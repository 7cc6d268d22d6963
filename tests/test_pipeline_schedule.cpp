// Pipeline schedules as data (train/pipeline_schedule.h) and their simulator
// (train/pipeline_simulator.h): every schedule runs without deadlock and runs each pass of
// each micro-batch once per stage; the bubbles and peak activations match the closed forms
// of the papers (derived below); broken schedules are caught.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "core/error.h"
#include "train/pipeline_schedule.h"
#include "train/pipeline_simulator.h"

namespace kiln::pipeline {
namespace {

// The (ranks, micro-batches) pairs every schedule is tried on: m in {1, p, 2p, 8, 16}.
std::vector<std::pair<int, int>> sizes() {
  std::vector<std::pair<int, int>> out;
  for (int p : {2, 4, 8})
    for (int m : {1, p, 2 * p, 8, 16})
      if (std::find(out.begin(), out.end(), std::pair{p, m}) == out.end()) out.push_back({p, m});
  return out;
}

struct Named {
  std::string name;
  std::function<Schedule(int p, int m)> build;
  bool valid(int p, int m) const { return name.rfind("interleaved", 0) != 0 || m % p == 0; }
};

std::vector<Named> all_builders() {
  return {{"gpipe", build_gpipe},
          {"1f1b", build_1f1b},
          {"zb-h1", build_zero_bubble_h1},
          {"interleaved v=2", [](int p, int m) { return build_interleaved_1f1b(p, 2, m); }},
          {"interleaved v=3", [](int p, int m) { return build_interleaved_1f1b(p, 3, m); }}};
}

// Counts each pass of each (micro-batch, stage) straight from the action lists -- apart
// from the simulator's own bookkeeping -- and checks it sits on the stage's rank.
void expect_each_pass_once(const Schedule& s) {
  std::map<std::tuple<int, int, char>, int> count;
  for (int r = 0; r < s.ranks; ++r)
    for (const Action& a : s.actions[r]) {
      char pass = 0;
      if (a.kind == ActionKind::kForward) pass = 'F';
      if (a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardInput) pass = 'B';
      if (a.kind == ActionKind::kBackwardWeight) pass = 'W';
      if (a.kind == ActionKind::kBackward) ++count[{a.microbatch, a.stage, 'W'}];
      if (!pass) continue;
      EXPECT_EQ(s.rank_of(a.stage), r) << describe(a);
      ++count[{a.microbatch, a.stage, pass}];
    }
  EXPECT_EQ(count.size(), static_cast<size_t>(3 * s.microbatches * s.stages())) << s.name;
  for (const auto& [key, n] : count)
    EXPECT_EQ(n, 1) << s.name << " micro-batch " << std::get<0>(key) << " stage " << std::get<1>(key) << " "
                    << std::get<2>(key);
}

TEST(PipelineSchedule, EveryScheduleRunsEachPassOnceWithoutDeadlock) {
  for (const auto& [p, m] : sizes())
    for (const Named& b : all_builders()) {
      if (!b.valid(p, m)) continue;
      SCOPED_TRACE(fmt::format("{} p={} m={}", b.name, p, m));
      const Schedule s = b.build(p, m);
      expect_each_pass_once(s);
      for (Costs costs : {Costs{}, Costs{1, 2, 1, 0}, Costs{1, 1, 1, 0.25}}) {
        const Simulation sim = simulate(s, costs);
        EXPECT_TRUE(sim.ok) << sim.problem;
        EXPECT_FALSE(sim.deadlock);
      }
    }
}

// GPipe and 1F1B (Huang et al. 2019; Narayanan et al. 2021, eq. 1): each rank idles
// (p-1)(F+B) of a step of (m+p-1)(F+B) -- the first micro-batch's forward and the last's
// backward pass through the other p-1 stages -- so the bubble is (p-1)/(m+p-1) of the step
// whatever F and B are. (The Megatron paper's (p-1)/m is the same idle time over the ideal
// time m(F+B) instead of the step.)
TEST(PipelineSchedule, GPipeAnd1F1BBubbleIsPMinus1OverMPlusPMinus1) {
  for (const auto& [p, m] : sizes())
    for (auto build : {build_gpipe, build_1f1b})
      for (Costs costs : {Costs{1, 1, 0, 0}, Costs{1, 1, 1, 0}, Costs{1, 3, 2, 0}}) {
        const Schedule s = build(p, m);
        SCOPED_TRACE(fmt::format("{} p={} m={} F={} B={}", s.name, p, m, costs.forward,
                                 costs.backward_input + costs.backward_weight));
        const Simulation sim = simulate(s, costs);
        ASSERT_TRUE(sim.ok) << sim.problem;
        const double fb = costs.forward + costs.backward_input + costs.backward_weight;
        EXPECT_DOUBLE_EQ(sim.makespan, (m + p - 1) * fb);
        EXPECT_NEAR(sim.bubble, (p - 1.0) / (m + p - 1), 1e-12);
        for (double rank_bubble : sim.bubble_fraction) EXPECT_NEAR(rank_bubble, (p - 1.0) / (m + p - 1), 1e-12);
      }
}

// 1F1B holds at most p - r micro-batches on rank r (its warm-up forwards plus the one
// before each backward); GPipe holds all m on every rank.
TEST(PipelineSchedule, PeakActivations1F1BVersusGPipe) {
  for (const auto& [p, m] : sizes()) {
    const Simulation one = simulate(build_1f1b(p, m));
    const Simulation gpipe = simulate(build_gpipe(p, m));
    ASSERT_TRUE(one.ok && gpipe.ok);
    for (int r = 0; r < p; ++r) {
      EXPECT_EQ(one.peak_in_flight[r], std::min(p - r, m)) << "p=" << p << " m=" << m << " rank " << r;
      EXPECT_EQ(gpipe.peak_in_flight[r], m) << "p=" << p << " m=" << m << " rank " << r;
    }
  }
}

// Transfers: each hop of the first forward and of the last backward adds its time to the
// step once: (m+p-1)(F+B) + 2(p-1)t for GPipe, worked out rank by rank (rank r finishes
// micro-batch k's backward at (p-1)(F+t) + mF + (k+1)B + (p-1-r)(B+t)).
TEST(PipelineSchedule, TransferTimeLengthensTheStepByTwoHopsPerStage) {
  for (const auto& [p, m] : sizes()) {
    const Costs costs{1, 2, 0, 0.5};
    const Simulation sim = simulate(build_gpipe(p, m), costs);
    ASSERT_TRUE(sim.ok) << sim.problem;
    EXPECT_DOUBLE_EQ(sim.makespan, (m + p - 1) * 3.0 + 2 * (p - 1) * 0.5) << "p=" << p << " m=" << m;
  }
}

// Interleaved 1F1B (Narayanan et al. 2021, section 2.2.2): each rank holds v stages of
// 1/v of its layers, so a stage's F and B take F/v and B/v. The warm-up and drain still
// cross p - 1 ranks, now at (F+B)/v each: idle (p-1)(F+B)/v in a step of
// m(F+B) + (p-1)(F+B)/v, a bubble of (p-1)/(v m + p - 1) (the paper's (1/v)(p-1)/m over
// the ideal time), whatever F and B are.
TEST(PipelineSchedule, InterleavedBubbleIsPMinus1OverVMPlusPMinus1) {
  for (const auto& [p, m] : sizes())
    for (int v : {2, 3, 4})
      for (double backward : {1.0, 2.0}) {
        if (m % p != 0) continue;
        const Schedule s = build_interleaved_1f1b(p, v, m);
        SCOPED_TRACE(fmt::format("p={} v={} m={} F=1 B={}", p, v, m, backward));
        const Simulation sim = simulate(s, Costs{1.0 / v, backward / v, 0, 0});
        ASSERT_TRUE(sim.ok) << sim.problem;
        EXPECT_NEAR(sim.makespan, (1 + backward) * (m + (p - 1.0) / v), 1e-9);
        EXPECT_NEAR(sim.bubble, (p - 1.0) / (v * m + p - 1), 1e-9);
      }
}

TEST(PipelineSchedule, InterleavedRefusesMicroBatchesNotDivisibleByRanks) {
  try {
    build_interleaved_1f1b(4, 2, 6);
    FAIL() << "6 micro-batches on 4 ranks were accepted";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "[train.grad_accum] interleaved 1F1B needs micro-batches (6) divisible by the pipeline ranks (4)");
  }
}

// ZB-H1 (Qi et al. 2023, section 3.1): rank r's idle time is (p-1)(F+B-W) when m >= p and
// W <= F -- 1F1B's (p-1)(F+B+W) less 2(p-1)W of weight passes moved into the warm-up
// and drain. Derivation at F = B = W = 1: the last rank idles p-1 waiting for its first
// input and then never again (it keeps up to p-1 W's for the end), so the step is
// 3m + p - 1 and every rank, busy 3m, idles p-1: a third of 1F1B's 3(p-1).
TEST(PipelineSchedule, ZeroBubbleH1IdlesPMinus1TimesFPlusBMinusW) {
  for (const auto& [p, m] : sizes()) {
    if (m < p) continue;
    for (Costs costs : {Costs{1, 1, 1, 0}, Costs{2, 2, 1, 0}, Costs{3, 2, 1, 0}}) {
      SCOPED_TRACE(fmt::format("p={} m={} F={} B={} W={}", p, m, costs.forward, costs.backward_input,
                               costs.backward_weight));
      const double f = costs.forward, b = costs.backward_input, w = costs.backward_weight;
      const Simulation zb = simulate(build_zero_bubble_h1(p, m), costs);
      const Simulation one = simulate(build_1f1b(p, m), costs);
      ASSERT_TRUE(zb.ok && one.ok) << zb.problem << one.problem;
      EXPECT_DOUBLE_EQ(zb.makespan, m * (f + b + w) + (p - 1) * (f + b - w));
      EXPECT_DOUBLE_EQ(one.makespan, (m + p - 1) * (f + b + w));
      for (int r = 0; r < p; ++r) {
        EXPECT_DOUBLE_EQ(zb.makespan - zb.busy[r], (p - 1) * (f + b - w)) << "rank " << r;
        // At most p micro-batches held on any rank: 1F1B's peak (its rank 0).
        EXPECT_LE(zb.peak_in_flight[r], p) << "rank " << r;
      }
      EXPECT_EQ(*std::max_element(zb.peak_in_flight.begin(), zb.peak_in_flight.end()),
                *std::max_element(one.peak_in_flight.begin(), one.peak_in_flight.end()));
    }
    // A W longer than F no longer fits the gaps it was moved into: (p-1)(W-F) more, an
    // idle time of (p-1)B, as the simulator measures it.
    for (Costs costs : {Costs{1, 1, 2, 0}, Costs{1, 2, 3, 0}}) {
      const Simulation zb = simulate(build_zero_bubble_h1(p, m), costs);
      ASSERT_TRUE(zb.ok) << zb.problem;
      const double f = costs.forward, b = costs.backward_input, w = costs.backward_weight;
      EXPECT_DOUBLE_EQ(zb.makespan, m * (f + b + w) + (p - 1) * b) << "p=" << p << " m=" << m << " W=" << w;
    }
  }
}

// Rank 0 receives micro-batch 0's gradient before it sends micro-batch 0's activation:
// rank 0 waits for rank 1, which waits for rank 0.
TEST(PipelineSchedule, SwappedSendAndReceiveIsADeadlock) {
  for (auto build : {build_gpipe, build_1f1b, build_zero_bubble_h1}) {
    Schedule s = build(4, 8);
    auto& list = s.actions[0];
    auto send = std::find(list.begin(), list.end(), Action{ActionKind::kSendActivation, 0, 0});
    auto recv = std::find(list.begin(), list.end(), Action{ActionKind::kRecvGradient, 0, 0});
    ASSERT_TRUE(send != list.end() && recv != list.end());
    std::iter_swap(send, recv);
    const Simulation sim = simulate(s);
    EXPECT_FALSE(sim.ok);
    EXPECT_TRUE(sim.deadlock) << sim.problem;
    EXPECT_NE(sim.problem.find("rank 0 waits at action 1 (rG0@0) for rank 1"), std::string::npos) << sim.problem;
    EXPECT_NE(sim.problem.find("rank 1 waits at action 0 (rA0@1) for rank 0"), std::string::npos) << sim.problem;
  }
}

TEST(PipelineSchedule, MissingDuplicatedOrMisorderedPassesAreReported) {
  {
    Schedule s = build_zero_bubble_h1(2, 4);
    auto& list = s.actions[1];
    list.erase(std::find(list.begin(), list.end(), Action{ActionKind::kBackwardWeight, 3, 1}));
    const Simulation sim = simulate(s);
    EXPECT_FALSE(sim.ok);
    EXPECT_FALSE(sim.deadlock);
    EXPECT_EQ(sim.problem, "micro-batch 3 never ran its weight gradient on stage 1");
  }
  {
    Schedule s = build_1f1b(2, 4);
    s.actions[1].push_back({ActionKind::kBackward, 2, 1});
    EXPECT_NE(simulate(s).problem.find("backward a second time"), std::string::npos);
  }
  {
    // The last stage's backward moved before its forward.
    Schedule s = build_gpipe(2, 2);
    auto& list = s.actions[1];
    std::iter_swap(std::find(list.begin(), list.end(), Action{ActionKind::kForward, 0, 1}),
                   std::find(list.begin(), list.end(), Action{ActionKind::kBackward, 0, 1}));
    EXPECT_NE(simulate(s).problem.find("backward before its forward"), std::string::npos);
  }
  {
    // A forward on the wrong rank.
    Schedule s = build_gpipe(2, 2);
    s.actions[0].push_back({ActionKind::kForward, 0, 1});
    EXPECT_NE(simulate(s).problem.find("stage 1 is on rank 1"), std::string::npos);
  }
}

// The table in docs/distributed.md ("Pipeline schedules"): 4 ranks, 8 and 16 micro-batches,
// F = B = W = 1 per rank's layers (an interleaved stage takes 1/v of them).
TEST(PipelineSchedule, DocsTable) {
  const int p = 4;
  fmt::print("| schedule | m | step | bubble (measured) | formula | bubble (formula) | peak in flight (rank 0..3) |\n");
  fmt::print("| --- | --- | --- | --- | --- | --- | --- |\n");
  for (int m : {8, 16}) {
    struct Row {
      Schedule s;
      double v;
      const char* formula;
      double expected;
    };
    const std::vector<Row> rows = {
        {build_gpipe(p, m), 1, "(p-1)/(m+p-1)", (p - 1.0) / (m + p - 1)},
        {build_1f1b(p, m), 1, "(p-1)/(m+p-1)", (p - 1.0) / (m + p - 1)},
        {build_interleaved_1f1b(p, 2, m), 2, "(p-1)/(vm+p-1), v=2", (p - 1.0) / (2 * m + p - 1)},
        {build_interleaved_1f1b(p, 4, m), 4, "(p-1)/(vm+p-1), v=4", (p - 1.0) / (4 * m + p - 1)},
        {build_zero_bubble_h1(p, m), 1, "(p-1)(F+B-W)/(m(F+B+W)+(p-1)(F+B-W))", (p - 1.0) / (3 * m + p - 1)},
    };
    for (const Row& row : rows) {
      const Simulation sim = simulate(row.s, Costs{1 / row.v, 1 / row.v, 1 / row.v, 0});
      ASSERT_TRUE(sim.ok) << sim.problem;
      EXPECT_NEAR(sim.bubble, row.expected, 1e-9) << row.s.name << " m=" << m;
      fmt::print("| {} | {} | {:g} | {:.3f} | {} | {:.3f} | {} |\n", row.s.name, m, sim.makespan, sim.bubble,
                 row.formula, row.expected, fmt::join(sim.peak_in_flight, ", "));
    }
  }
}

}  // namespace
}  // namespace kiln::pipeline

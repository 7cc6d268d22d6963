#include "train/pipeline_simulator.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>

#include "core/error.h"

namespace kiln::pipeline {
namespace {

constexpr double kNotYet = -1;

// One transfer, named by what it carries and the stage that receives it.
struct TransferKey {
  bool gradient;
  int microbatch, to_stage;
  auto operator<=>(const TransferKey&) const = default;
};

struct Posted {
  double time = 0;
  bool received = false;
};

// What has happened to each (micro-batch, stage), and the transfers in flight.
class Run {
 public:
  Run(const Schedule& schedule, const Costs& costs)
      : s_(schedule), costs_(costs), pairs_(schedule.microbatches * schedule.stages()),
        forward_(pairs_, kNotYet), input_grad_(pairs_, kNotYet), weight_done_(pairs_, false),
        split_(pairs_, false), got_activation_(pairs_, kNotYet), got_gradient_(pairs_, kNotYet),
        pc_(s_.ranks, 0), clock_(s_.ranks, 0), busy_(s_.ranks, 0), in_flight_(s_.ranks, 0),
        peak_(s_.ranks, 0) {}

  Simulation run() {
    Simulation out;
    for (bool progress = true; progress;) {
      progress = false;
      for (int r = 0; r < s_.ranks; ++r) {
        while (pc_[r] < s_.actions[r].size()) {
          const Step step = execute(r, s_.actions[r][pc_[r]]);
          if (step == Step::kError) return failed(out);
          if (step == Step::kBlocked) break;
          ++pc_[r];
          progress = true;
        }
      }
    }
    if (!all_finished()) {
      out.deadlock = true;
      problem_ = "deadlock: " + who_waits();
      return failed(out);
    }
    if (!check_complete()) return failed(out);
    out.ok = true;
    out.makespan = *std::max_element(clock_.begin(), clock_.end());
    out.busy = busy_;
    out.peak_in_flight = peak_;
    double idle = 0;
    for (int r = 0; r < s_.ranks; ++r) {
      const double rank_idle = out.makespan - busy_[r];
      out.bubble_fraction.push_back(out.makespan > 0 ? rank_idle / out.makespan : 0);
      idle += rank_idle;
    }
    out.bubble = out.makespan > 0 ? idle / (s_.ranks * out.makespan) : 0;
    return out;
  }

 private:
  enum class Step { kDone, kBlocked, kError };

  int pair(int microbatch, int stage) const { return microbatch * s_.stages() + stage; }
  int last_stage() const { return s_.stages() - 1; }

  Step error(int r, const Action& a, const std::string& what) {
    problem_ = fmt::format("rank {} action {} ({}): {}", r, pc_[r], describe(a), what);
    return Step::kError;
  }

  // Runs `cost` on rank r once `ready` (the time its inputs are there) has come.
  double compute(int r, double ready, double cost) {
    clock_[r] = std::max(clock_[r], ready) + cost;
    busy_[r] += cost;
    return clock_[r];
  }

  void hold(int r, int delta) {
    in_flight_[r] += delta;
    peak_[r] = std::max(peak_[r], in_flight_[r]);
  }

  // When the input of stage a.stage for a.microbatch is on rank r: a received
  // activation, or the previous stage's output when that stage is on r too.
  double input_ready(int r, const Action& a) const {
    if (a.stage == 0) return 0;
    if (s_.rank_of(a.stage - 1) == r) return forward_[pair(a.microbatch, a.stage - 1)];
    return got_activation_[pair(a.microbatch, a.stage)];
  }
  double output_grad_ready(int r, const Action& a) const {
    const int p = pair(a.microbatch, a.stage);
    if (a.stage == last_stage()) return forward_[p];  // the loss is this stage's
    if (s_.rank_of(a.stage + 1) == r) return input_grad_[pair(a.microbatch, a.stage + 1)];
    return got_gradient_[p];
  }

  Step execute(int r, const Action& a) {
    if (a.microbatch < 0 || a.microbatch >= s_.microbatches || a.stage < 0 || a.stage > last_stage())
      return error(r, a, "no such micro-batch or stage");
    if (s_.rank_of(a.stage) != r) return error(r, a, fmt::format("stage {} is on rank {}", a.stage, s_.rank_of(a.stage)));
    const int p = pair(a.microbatch, a.stage);
    switch (a.kind) {
      case ActionKind::kForward: {
        if (forward_[p] != kNotYet) return error(r, a, "forward a second time");
        const double ready = input_ready(r, a);
        if (ready == kNotYet) return error(r, a, "forward before its input arrived");
        forward_[p] = compute(r, ready, costs_.forward);
        hold(r, +1);
        return Step::kDone;
      }
      case ActionKind::kBackward:
      case ActionKind::kBackwardInput: {
        if (input_grad_[p] != kNotYet) return error(r, a, "backward a second time");
        if (forward_[p] == kNotYet) return error(r, a, "backward before its forward");
        const double ready = output_grad_ready(r, a);
        if (ready == kNotYet) return error(r, a, "backward before its output gradient arrived");
        const bool whole = a.kind == ActionKind::kBackward;
        input_grad_[p] = compute(r, ready, costs_.backward_input + (whole ? costs_.backward_weight : 0));
        split_[p] = !whole;
        if (whole) {
          weight_done_[p] = true;
          hold(r, -1);
        }
        return Step::kDone;
      }
      case ActionKind::kBackwardWeight: {
        if (weight_done_[p]) return error(r, a, "weight gradient a second time");
        if (input_grad_[p] == kNotYet || !split_[p]) return error(r, a, "weight gradient before its B");
        compute(r, 0, costs_.backward_weight);
        weight_done_[p] = true;
        hold(r, -1);
        return Step::kDone;
      }
      case ActionKind::kSendActivation:
      case ActionKind::kSendGradient: {
        const bool gradient = a.kind == ActionKind::kSendGradient;
        const int to = a.stage + (gradient ? -1 : 1);
        if (to < 0 || to > last_stage()) return error(r, a, "sends past the pipeline's end");
        if (s_.rank_of(to) == r) return error(r, a, "sends to its own rank");
        if ((gradient ? input_grad_[p] : forward_[p]) == kNotYet) return error(r, a, "sends what it has not computed");
        if (!posted_.emplace(TransferKey{gradient, a.microbatch, to}, Posted{clock_[r]}).second)
          return error(r, a, "sends a second time");
        return Step::kDone;
      }
      case ActionKind::kRecvActivation:
      case ActionKind::kRecvGradient: {
        const bool gradient = a.kind == ActionKind::kRecvGradient;
        if (gradient ? a.stage == last_stage() : a.stage == 0) return error(r, a, "receives from past the pipeline's end");
        auto it = posted_.find({gradient, a.microbatch, a.stage});
        if (it == posted_.end()) return Step::kBlocked;  // its send is not posted yet
        if (it->second.received) return error(r, a, "receives a second time");
        it->second.received = true;
        clock_[r] = std::max(clock_[r], it->second.time + costs_.transfer);
        (gradient ? got_gradient_ : got_activation_)[p] = clock_[r];
        return Step::kDone;
      }
    }
    return error(r, a, "unknown action");
  }

  bool all_finished() const {
    for (int r = 0; r < s_.ranks; ++r)
      if (pc_[r] < s_.actions[r].size()) return false;
    return true;
  }

  // "rank 0 waits at action 5 (rG0@0) for rank 1; rank 1 waits at ...; rank 2 finished".
  std::string who_waits() const {
    std::string out;
    for (int r = 0; r < s_.ranks; ++r) {
      if (!out.empty()) out += "; ";
      if (pc_[r] == s_.actions[r].size()) {
        out += fmt::format("rank {} finished", r);
        continue;
      }
      const Action& a = s_.actions[r][pc_[r]];
      const int from = a.kind == ActionKind::kRecvGradient ? a.stage + 1 : a.stage - 1;
      out += fmt::format("rank {} waits at action {} ({}) for rank {}", r, pc_[r], describe(a),
                         s_.rank_of(std::clamp(from, 0, last_stage())));
    }
    return out;
  }

  bool check_complete() {
    for (int m = 0; m < s_.microbatches; ++m)
      for (int st = 0; st < s_.stages(); ++st) {
        const int p = pair(m, st);
        const char* missing = forward_[p] == kNotYet       ? "forward"
                              : input_grad_[p] == kNotYet ? "backward"
                              : !weight_done_[p]          ? "weight gradient"
                                                          : nullptr;
        if (missing) {
          problem_ = fmt::format("micro-batch {} never ran its {} on stage {}", m, missing, st);
          return false;
        }
      }
    for (const auto& [key, posted] : posted_)
      if (!posted.received) {
        problem_ = fmt::format("the {} of micro-batch {} for stage {} was sent and never received",
                               key.gradient ? "gradient" : "activation", key.microbatch, key.to_stage);
        return false;
      }
    return true;
  }

  Simulation& failed(Simulation& out) {
    out.ok = false;
    out.problem = problem_;
    return out;
  }

  const Schedule& s_;
  const Costs costs_;
  const int pairs_;
  std::vector<double> forward_, input_grad_;  // when each (micro-batch, stage) pass finished
  std::vector<bool> weight_done_, split_;
  std::vector<double> got_activation_, got_gradient_;  // when each receive finished
  std::map<TransferKey, Posted> posted_;
  std::vector<size_t> pc_;  // each rank's next action
  std::vector<double> clock_, busy_;
  std::vector<int> in_flight_, peak_;
  std::string problem_;
};

}  // namespace

Simulation simulate(const Schedule& schedule, const Costs& costs) {
  KILN_CHECK(static_cast<int>(schedule.actions.size()) == schedule.ranks, "pipeline",
             "schedule {} has action lists for {} ranks, not {}", schedule.name, schedule.actions.size(),
             schedule.ranks);
  return Run(schedule, costs).run();
}

}  // namespace kiln::pipeline

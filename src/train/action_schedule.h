// The training loop's periodic actions -- logging, validation, samples, evaluation,
// checkpoints, exports -- on one schedule: each is added once with its cadence, and after
// every step the schedule runs those due, in the order they were added. The loop itself
// only trains and asks the schedule.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

namespace kiln {

// One step as the schedule sees it: its number (1-based), the run's last, and the tokens
// trained before and after it (every rank's).
struct StepSpan {
  int64_t step = 0, last_step = 0;
  int64_t tokens_before = 0, tokens_after = 0;
  bool last() const { return step == last_step; }
};

// When an action is due: every `steps` steps, or each time the tokens trained cross a
// multiple of `tokens` (0: not by that measure). After the run's last step only actions
// that ask for it run (at_last_step); the others are the end-of-run's (Trainer::finish).
struct Cadence {
  int64_t steps = 0, tokens = 0;
  bool at_last_step = false;
  bool due(const StepSpan& span) const;
  // Whether `span` is one of the cadence's steps, the last one too (for what the end of the
  // run does in the action's place).
  bool crossed(const StepSpan& span) const;
};

class ActionSchedule {
 public:
  using Action = std::function<void(const StepSpan&)>;
  // `name` (a literal) names its phase (core/phase_scope.h). An action whose cadence can
  // never be due is left out.
  void add(const char* name, Cadence cadence, Action action);
  // Runs every action due after `span`'s step, in the order added, each in its phase.
  void run_due(const StepSpan& span) const;

 private:
  struct Entry {
    const char* name;
    Cadence cadence;
    Action action;
  };
  std::vector<Entry> entries_;
};

}  // namespace kiln

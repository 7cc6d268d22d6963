// Numerical fault guard: decides, before the optimizer runs, whether a step's update is
// safe to apply. A non-finite loss or gradient norm, or (optional spike guard) a loss or
// gradient norm far above its recent window, skips the update: weights, optimizer state
// and the schedule position stay exactly as they were, and only the data moves on.
// Too many skips in a row stop the run with an error instead of training on garbage.
//
// The window and counters are part of a checkpoint, so a resumed run makes the same
// decisions as one that never stopped.
#pragma once

#include "config/config.h"
#include "ops/optim/step_rules.h"

#include <cstdint>
#include <string>
#include <vector>

namespace kiln {

struct FaultGuardState {
  int64_t consecutive_skips = 0;
  int64_t total_skips = 0;
  std::vector<double> recent_loss;       // accepted steps only, oldest first
  std::vector<double> recent_grad_norm;  // same steps

  bool operator==(const FaultGuardState&) const = default;
};

class FaultGuard {
 public:
  explicit FaultGuard(const TrainConfig& config);

  // Why this step's update must be skipped, or "" to apply it. `grad_norm` is the global
  // norm before clipping. The rules are ops::step_verdict's (ops/optim/step_rules.h).
  std::string check(double loss, double grad_norm) const;
  // The reason check() gives for a verdict already reached from these values (by the
  // device step, which applies the same rules to the same limits).
  std::string reason(ops::StepVerdict verdict, double loss, double grad_norm) const;
  // The spike limits check() applies now: skip when loss > *loss_limit or grad_norm >
  // *grad_limit (+inf while the guard is off or its window not yet full). A step deciding
  // on the device (train/step_program.h) compares against these.
  void spike_limits(double* loss_limit, double* grad_limit) const;
  // The update was applied: the values enter the spike window.
  void accept(double loss, double grad_norm);
  // The update was skipped. Throws kiln::Error("[train] step N: ...") once
  // train.max_consecutive_skips updates in a row were skipped.
  void skip(int64_t step, const std::string& reason);

  const FaultGuardState& state() const { return state_; }
  // A saved window longer than train.spike_window keeps its newest entries.
  void restore(const FaultGuardState& state);

 private:
  int64_t max_consecutive_;
  size_t window_;
  double loss_ratio_, grad_ratio_;
  FaultGuardState state_;
};

}  // namespace kiln

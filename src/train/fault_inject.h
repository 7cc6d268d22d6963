// Test-only fault injection: KILN_FAULT_INJECT="name:arg[,name:arg...]" makes a run fail
// for real at a chosen point, so the fault tests (tests/test_faults.cpp) exercise the
// same code a real crash, full disk or bad number would. Unset (always, outside tests)
// nothing is injected; the per-step checks are a few integer compares.
//
//   checkpoint_write:<point>[@<n>]  SIGKILL this process at a point of the n-th (default
//                             first) checkpoint save: begin, model, optimizer, partial
//                             (state.json half written), state, manifest, rename, latest
//                             (in protocol order; see checkpoint.cpp); shard: a ZeRO
//                             rank, with its optimizer shard file half written
//   checkpoint_enospc:<n>     the n-th checkpoint save of this process fails with ENOSPC
//                             after writing part of its optimizer file
//   checkpoint_delete:fail    deleting an old checkpoint (retention) fails
//   kill_at_step:<n>          SIGKILL at the start of step n (1-based)
//   nan_loss:<n>[-<m>]        the loss of steps n..m is NaN
//   inf_grad:<n>[-<m>]        one gradient element of steps n..m is +Inf
//   grad_spike:<n>[-<m>]      gradients of steps n..m are scaled by 1e4
//   step_delay_ms:<ms>        sleep this long in every step (signal tests)
//   eval_delay_ms:<ms>        sleep this long before each validation batch and each
//                             sampled token (signal tests of the end-of-run work)
//   eval_error:<what>         every validation (what = validation) or sample (sample)
//                             fails with an error
//   nan_validation:all        every validation loss is NaN (a diverged model's)
#pragma once

#include "nn/parameter.h"

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace kiln {

class FaultInjector {
 public:
  FaultInjector() = default;
  // Parses `spec` (the env var's value); unknown names or bad arguments throw naming
  // KILN_FAULT_INJECT, so a typo in a test cannot silently inject nothing.
  explicit FaultInjector(std::string_view spec);
  static FaultInjector from_env();

  bool any() const { return !faults_.empty(); }
  // Any of nan_loss, inf_grad, grad_spike: they act between a step's backward and its
  // guard, so a GPU step then runs op by op (Trainer).
  bool numeric() const;
  // True when checkpoint_write names `point` of save number `save` (1-based).
  bool at_write_point(std::string_view point, int64_t save) const;
  // SIGKILLs the process there.
  void kill_point(std::string_view point, int64_t save) const;
  // True when fault `name` (a step-range fault) covers 1-based step `step`.
  bool at_step(std::string_view name, int64_t step) const;
  // The argument of `name` as an integer, or `fallback` when not injected.
  int64_t value(std::string_view name, int64_t fallback) const;
  bool has(std::string_view name, std::string_view arg) const;

 private:
  struct Fault {
    std::string name, arg;
    int64_t first = 0, last = 0;  // step range or value
  };
  std::vector<Fault> faults_;
};

// At the start of step `step`: kill_at_step, step_delay_ms.
void inject_before_step(const FaultInjector& faults, int64_t step);
// Before each validation batch or sampled token (`what`: "validation" or "sample"), and with
// `starting` once before the first: eval_delay_ms, eval_error.
void inject_eval_faults(const FaultInjector& faults, std::string_view what, bool starting);
// After a step's backward, before the fault guard looks: nan_loss, inf_grad, grad_spike
// (on the model's context, `exec`, where its step runs).
void inject_numeric_faults(const ExecContext& exec, const FaultInjector& faults, int64_t step, double& loss,
                           const std::vector<std::unique_ptr<Parameter>>& parameters);

// Kills the calling process with SIGKILL (no handlers, no flushing: a real crash).
[[noreturn]] void kill_self();

}  // namespace kiln

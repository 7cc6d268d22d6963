// How far a candidate run's loss lies from a baseline's, measured against the noise floor
// of two baseline runs that differ only in their seed (seed 000's check that a precision
// such as FP8 trains "at a loss gap inside run-to-run noise"): the candidate shares the
// first baseline's seed, so their difference is the change under test; the two baselines'
// difference is what a seed alone moves. `kiln loss-gap` trains the three runs and prints
// this; docs/loss-gap.md.
#pragma once

#include "plot/run_metrics.h"

#include <cstdint>
#include <optional>
#include <string>

namespace kiln::plot {

// Two runs' losses compared over the steps both logged.
struct LossDifference {
  int64_t records = 0;          // train records compared (those both runs logged at the same step)
  int64_t first_step = 0, last_step = 0;
  double mean_absolute = 0;     // mean over those records of |other - reference|
  double mean_signed = 0;       // mean of other - reference: > 0 when the other trains worse
};

struct FinalValidation {
  int64_t step = 0;
  double baseline = 0, second_baseline = 0, candidate = 0;
};

struct LossGap {
  LossDifference noise;  // second baseline against baseline
  LossDifference gap;    // candidate against baseline
  double ratio = 0;      // gap.mean_absolute / noise.mean_absolute (infinite when the floor is 0)
  std::optional<FinalValidation> validation;  // the last validation step all three logged
};

// Compares the train records (each the mean loss of its log window) at the steps all three
// runs logged, from `from_step` on. Fails naming the run when the runs share no such step,
// or when the candidate's loss is not finite where the baseline's is (a diverged run, not
// a gap).
LossGap measure_loss_gap(const RunMetrics& baseline, const RunMetrics& second_baseline, const RunMetrics& candidate,
                         int64_t from_step = 0);

// The report's lines, e.g. "noise floor 0.0123: mean |loss difference| of baseline-seed2
// against baseline-seed1 over 60 train records (steps 10-600)".
std::string describe_loss_gap(const LossGap& gap, const RunMetrics& baseline, const RunMetrics& second_baseline,
                              const RunMetrics& candidate);

}  // namespace kiln::plot

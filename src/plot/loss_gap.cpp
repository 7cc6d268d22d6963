#include "plot/loss_gap.h"

#include "core/error.h"

#include <fmt/format.h>

#include <cmath>
#include <limits>
#include <map>

namespace kiln::plot {

namespace {

constexpr const char* kWhere = "loss-gap";

std::map<int64_t, double> losses_by_step(const RunMetrics& run, int64_t from_step) {
  std::map<int64_t, double> losses;
  for (const TrainPoint& p : run.train)
    if (p.step >= from_step) losses[p.step] = p.loss;
  return losses;
}

std::string name_of(const RunMetrics& run) { return run.label.empty() ? run.file : run.label; }

}  // namespace

LossGap measure_loss_gap(const RunMetrics& baseline, const RunMetrics& second_baseline, const RunMetrics& candidate,
                         int64_t from_step) {
  const std::map<int64_t, double> base = losses_by_step(baseline, from_step);
  const std::map<int64_t, double> second = losses_by_step(second_baseline, from_step);
  const std::map<int64_t, double> cand = losses_by_step(candidate, from_step);

  LossGap result;
  double noise_abs = 0, noise_signed = 0, gap_abs = 0, gap_signed = 0;
  int64_t records = 0, first = 0, last = 0;
  for (const auto& [step, b] : base) {
    const auto s = second.find(step), c = cand.find(step);
    if (s == second.end() || c == cand.end()) continue;
    // A window whose every step the fault guard skipped has no loss. Left out when the
    // baselines have none; a candidate without a loss where the baseline trained diverged.
    if (!std::isfinite(b) || !std::isfinite(s->second)) continue;
    if (!std::isfinite(c->second))
      fail(kWhere, "{}: no finite loss at step {} where {} has {:.4f}: the candidate diverged, there is no gap to measure",
           name_of(candidate), step, name_of(baseline), b);
    if (records == 0) first = step;
    last = step;
    ++records;
    noise_abs += std::fabs(s->second - b);
    noise_signed += s->second - b;
    gap_abs += std::fabs(c->second - b);
    gap_signed += c->second - b;
  }
  if (records == 0)
    fail(kWhere, "{}, {} and {} share no train record at a step >= {}: compare runs of the same steps and log.every",
         baseline.file, second_baseline.file, candidate.file, from_step);
  const double n = static_cast<double>(records);
  result.noise = {records, first, last, noise_abs / n, noise_signed / n};
  result.gap = {records, first, last, gap_abs / n, gap_signed / n};
  result.ratio = result.noise.mean_absolute > 0 ? result.gap.mean_absolute / result.noise.mean_absolute
                                                : std::numeric_limits<double>::infinity();

  std::map<int64_t, double> base_val, second_val;
  for (const ValidationPoint& v : baseline.validation) base_val[v.step] = v.loss;
  for (const ValidationPoint& v : second_baseline.validation) second_val[v.step] = v.loss;
  for (auto v = candidate.validation.rbegin(); v != candidate.validation.rend(); ++v) {
    const auto b = base_val.find(v->step), s = second_val.find(v->step);
    if (b == base_val.end() || s == second_val.end()) continue;
    result.validation = FinalValidation{v->step, b->second, s->second, v->loss};
    break;
  }
  return result;
}

std::string describe_loss_gap(const LossGap& gap, const RunMetrics& baseline, const RunMetrics& second_baseline,
                              const RunMetrics& candidate) {
  const auto span = [](const LossDifference& d) {
    return fmt::format("{} train records, steps {}-{}", d.records, d.first_step, d.last_step);
  };
  std::string text = fmt::format(
      "noise floor {:.5f}: mean |loss difference| of {} against {} ({}; mean signed {:+.5f})\n"
      "gap {:.5f}: mean |loss difference| of {} against {} (mean signed {:+.5f}): {:.2f}x the noise floor\n",
      gap.noise.mean_absolute, name_of(second_baseline), name_of(baseline), span(gap.noise), gap.noise.mean_signed,
      gap.gap.mean_absolute, name_of(candidate), name_of(baseline), gap.gap.mean_signed, gap.ratio);
  if (gap.validation)
    text += fmt::format("validation loss at step {}: {} {:.5f}, {} {:.5f}, {} {:.5f}\n", gap.validation->step,
                        name_of(baseline), gap.validation->baseline, name_of(second_baseline),
                        gap.validation->second_baseline, name_of(candidate), gap.validation->candidate);
  return text;
}

}  // namespace kiln::plot

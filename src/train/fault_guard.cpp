#include "train/fault_guard.h"

#include "core/error.h"

#include <fmt/format.h>

#include <cmath>
#include <limits>

namespace kiln {

namespace {

double mean(const std::vector<double>& v) {
  double sum = 0;
  for (double x : v) sum += x;  // in order: the same sum on every run and after resume
  return sum / static_cast<double>(v.size());
}

void push_window(std::vector<double>& v, double x, size_t window) {
  if (v.size() == window) v.erase(v.begin());  // no allocation: capacity is reserved
  v.push_back(x);
}

}  // namespace

FaultGuard::FaultGuard(const TrainConfig& config)
    : max_consecutive_(config.max_consecutive_skips),
      window_(static_cast<size_t>(config.spike_window)),
      loss_ratio_(config.spike_loss_ratio),
      grad_ratio_(config.spike_grad_ratio) {
  if (window_ > 0) {
    // A ratio at or below 1 would skip every update above the average: never meant.
    KILN_CHECK(loss_ratio_ > 1, "train.spike_loss_ratio", "must be > 1 when train.spike_window > 0, got {}",
               loss_ratio_);
    KILN_CHECK(grad_ratio_ > 1, "train.spike_grad_ratio", "must be > 1 when train.spike_window > 0, got {}",
               grad_ratio_);
  }
  state_.recent_loss.reserve(window_);
  state_.recent_grad_norm.reserve(window_);
}

void FaultGuard::spike_limits(double* loss_limit, double* grad_limit) const {
  *loss_limit = *grad_limit = std::numeric_limits<double>::infinity();
  // The spike guard waits for a full window: early losses fall fast and say little.
  if (window_ == 0 || state_.recent_loss.size() < window_) return;
  *loss_limit = loss_ratio_ * mean(state_.recent_loss);
  *grad_limit = grad_ratio_ * mean(state_.recent_grad_norm);
}

std::string FaultGuard::check(double loss, double grad_norm) const {
  double loss_limit = 0, grad_limit = 0;
  spike_limits(&loss_limit, &grad_limit);
  return reason(ops::step_verdict(loss, grad_norm, loss_limit, grad_limit), loss, grad_norm);
}

std::string FaultGuard::reason(ops::StepVerdict verdict, double loss, double grad_norm) const {
  double loss_limit = 0, grad_limit = 0;
  spike_limits(&loss_limit, &grad_limit);
  switch (verdict) {
    case ops::StepVerdict::apply: return {};
    case ops::StepVerdict::non_finite_loss: return fmt::format("non-finite loss {}", loss);
    case ops::StepVerdict::non_finite_grad_norm: return fmt::format("non-finite gradient norm {}", grad_norm);
    case ops::StepVerdict::loss_spike:
      return fmt::format("loss spike {:.4g} > {} x recent mean {:.4g}", loss, loss_ratio_, loss_limit / loss_ratio_);
    case ops::StepVerdict::grad_spike:
      return fmt::format("gradient norm spike {:.4g} > {} x recent mean {:.4g}", grad_norm, grad_ratio_,
                         grad_limit / grad_ratio_);
  }
  fail("train", "unknown step verdict {}", static_cast<int>(verdict));
}

void FaultGuard::accept(double loss, double grad_norm) {
  state_.consecutive_skips = 0;
  if (window_ == 0) return;
  push_window(state_.recent_loss, loss, window_);
  push_window(state_.recent_grad_norm, grad_norm, window_);
}

void FaultGuard::skip(int64_t step, const std::string& reason) {
  ++state_.consecutive_skips;
  ++state_.total_skips;
  if (max_consecutive_ > 0 && state_.consecutive_skips >= max_consecutive_)
    fail("train",
         "step {}: {} consecutive updates skipped (last: {}); stopping (train.max_consecutive_skips = {}). Resume "
         "from the last checkpoint, e.g. with a lower optim.lr",
         step, state_.consecutive_skips, reason, max_consecutive_);
}

void FaultGuard::restore(const FaultGuardState& state) {
  KILN_CHECK(state.recent_loss.size() == state.recent_grad_norm.size(), "checkpoint",
             "saved spike window has {} losses but {} gradient norms", state.recent_loss.size(),
             state.recent_grad_norm.size());
  state_ = state;
  // A run resumed with a shorter train.spike_window keeps the newest entries.
  const size_t n = state_.recent_loss.size(), drop = n > window_ ? n - window_ : 0;
  state_.recent_loss.erase(state_.recent_loss.begin(), state_.recent_loss.begin() + static_cast<ptrdiff_t>(drop));
  state_.recent_grad_norm.erase(state_.recent_grad_norm.begin(),
                                state_.recent_grad_norm.begin() + static_cast<ptrdiff_t>(drop));
  state_.recent_loss.reserve(window_);
  state_.recent_grad_norm.reserve(window_);
}

}  // namespace kiln

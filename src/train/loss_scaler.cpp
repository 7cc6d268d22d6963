#include "train/loss_scaler.h"

#include <algorithm>

namespace kiln {

namespace {
// Far below where fp32 gradients times the scale would overflow anyway; keeps S finite.
constexpr double kLargestScale = 0x1p100;
}  // namespace

LossScaler::LossScaler(const TrainConfig& config)
    : enabled_(config.loss_scale == "dynamic"), growth_interval_(config.loss_scale_growth_interval) {
  if (enabled_) state_.scale = config.loss_scale_init;
}

bool LossScaler::after_step(ops::StepVerdict verdict) {
  if (!enabled_) return false;
  if (verdict == ops::StepVerdict::non_finite_grad_norm && state_.scale > 1) {
    state_.scale /= 2;
    state_.clean_steps = 0;
    ++state_.overflows;
    return true;
  }
  if (verdict == ops::StepVerdict::apply && ++state_.clean_steps >= growth_interval_) {
    state_.scale = std::min(state_.scale * 2, kLargestScale);
    state_.clean_steps = 0;
  }
  return false;
}

void LossScaler::restore(const LossScalerState& state) {
  if (enabled_) state_ = state;
}

}  // namespace kiln

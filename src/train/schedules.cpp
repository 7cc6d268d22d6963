#include "train/schedules.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <numbers>

namespace kiln {

namespace {

// Every schedule warms up linearly from lr / warmup_steps to lr over the first warmup_steps
// steps; after that each has its own shape.
double warmed_up(const OptimConfig& c, int64_t step) {
  return c.lr * static_cast<double>(step + 1) / static_cast<double>(c.warmup_steps);
}

// lr * min_lr_ratio + (lr - lr * min_lr_ratio) * f: a decay factor f from 1 to 0 mapped
// onto [lr * min_lr_ratio, lr].
double between(const OptimConfig& c, double f) { return c.lr * (c.min_lr_ratio + (1.0 - c.min_lr_ratio) * f); }

// The progress of `step` through a span of `length` steps starting at `first`: 0 at its
// first step, 1 at its last (a span of one step is at 1).
double progress(int64_t step, int64_t first, int64_t length) {
  const int64_t last = std::max<int64_t>(1, length - 1);
  return std::clamp(static_cast<double>(step - first) / static_cast<double>(last), 0.0, 1.0);
}

double cosine_factor(double p) { return 0.5 * (1.0 + std::cos(std::numbers::pi * p)); }

// Linear warmup from 0, then cosine from lr down to lr * min_lr_ratio at the last step.
class CosineSchedule final : public Schedule {
 public:
  CosineSchedule(const OptimConfig& c, int64_t total) : c_(c), total_(total) {}
  double lr(int64_t step) const override {
    if (step < c_.warmup_steps) return warmed_up(c_, step);
    return between(c_, cosine_factor(progress(step, c_.warmup_steps, total_ - c_.warmup_steps)));
  }

 private:
  OptimConfig c_;
  int64_t total_;
};

// Linear warmup, then a straight line from lr down to lr * min_lr_ratio at the last step.
class LinearSchedule final : public Schedule {
 public:
  LinearSchedule(const OptimConfig& c, int64_t total) : c_(c), total_(total) {}
  double lr(int64_t step) const override {
    if (step < c_.warmup_steps) return warmed_up(c_, step);
    return between(c_, 1.0 - progress(step, c_.warmup_steps, total_ - c_.warmup_steps));
  }

 private:
  OptimConfig c_;
  int64_t total_;
};

class ConstantSchedule final : public Schedule {
 public:
  explicit ConstantSchedule(const OptimConfig& c) : c_(c) {}
  double lr(int64_t step) const override { return step < c_.warmup_steps ? warmed_up(c_, step) : c_.lr; }

 private:
  OptimConfig c_;
};

// Warmup-stable-decay (MiniCPM's WSD, DeepSeek's multi-step): warmup, lr held, then a tail
// of decay_steps (or decay_fraction of the run) down to lr * min_lr_ratio at the last step,
// shaped linear, cosine or 1 - sqrt (Hagele et al. 2024). The tail sits at the end of
// `total`: a run resumed with more steps stays in the stable phase and decays at its new end.
class WsdSchedule final : public Schedule {
 public:
  WsdSchedule(const OptimConfig& c, int64_t total) : c_(c), total_(total) {
    const int64_t asked = c.decay_steps > 0 ? c.decay_steps
                                            : static_cast<int64_t>(std::llround(c.decay_fraction * static_cast<double>(total)));
    decay_ = std::clamp<int64_t>(asked, 0, std::max<int64_t>(0, total - c.warmup_steps));
  }
  double lr(int64_t step) const override {
    if (step < c_.warmup_steps) return warmed_up(c_, step);
    const int64_t first = total_ - decay_;
    if (decay_ == 0 || step < first) return c_.lr;
    const double p = progress(step, first, decay_);
    const double f = c_.decay_shape == "cosine" ? cosine_factor(p) : c_.decay_shape == "1-sqrt" ? 1.0 - std::sqrt(p) : 1.0 - p;
    return between(c_, f);
  }

 private:
  OptimConfig c_;
  int64_t total_;
  int64_t decay_;  // steps of the tail
};

}  // namespace

ScheduleRegistry& schedule_registry() {
  static ScheduleRegistry* registry = [] {
    auto* r = new ScheduleRegistry("schedule");
    r->add("cosine", "linear warmup, cosine decay to lr * min_lr_ratio",
           [](const OptimConfig& c, int64_t total) { return std::make_unique<CosineSchedule>(c, total); });
    r->add("linear", "linear warmup, linear decay to lr * min_lr_ratio",
           [](const OptimConfig& c, int64_t total) { return std::make_unique<LinearSchedule>(c, total); });
    r->add("constant", "linear warmup, then constant",
           [](const OptimConfig& c, int64_t) { return std::make_unique<ConstantSchedule>(c); });
    r->add("wsd", "warmup, stable, then a decay tail (optim.decay_steps / decay_fraction, decay_shape)",
           [](const OptimConfig& c, int64_t total) { return std::make_unique<WsdSchedule>(c, total); });
    return r;
  }();
  return *registry;
}

std::unique_ptr<Schedule> make_schedule(const OptimConfig& config, int64_t total_steps, int64_t tokens_per_step) {
  KILN_CHECK(tokens_per_step > 0, "optim.schedule", "a step of {} tokens", tokens_per_step);
  OptimConfig c = config;
  auto steps_of = [&](int64_t tokens) { return (tokens + tokens_per_step - 1) / tokens_per_step; };
  if (c.warmup_tokens > 0) c.warmup_steps = steps_of(c.warmup_tokens);
  if (c.decay_tokens > 0) c.decay_steps = steps_of(c.decay_tokens);
  return schedule_registry().build("optim.schedule", c.schedule, c, total_steps);
}

}  // namespace kiln

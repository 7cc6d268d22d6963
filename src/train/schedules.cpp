#include "train/schedules.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <numbers>

namespace kiln {

namespace {

// Linear warmup from 0, then cosine from lr down to lr * min_lr_ratio at the last step.
class CosineSchedule final : public Schedule {
 public:
  CosineSchedule(const OptimConfig& c, int64_t total) : c_(c), total_(total) {}
  double lr(int64_t step) const override {
    if (step < c_.warmup_steps) return c_.lr * static_cast<double>(step + 1) / static_cast<double>(c_.warmup_steps);
    const int64_t span = std::max<int64_t>(1, total_ - c_.warmup_steps - 1);
    const double progress = std::min(1.0, static_cast<double>(step - c_.warmup_steps) / static_cast<double>(span));
    const double cosine = 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
    return c_.lr * (c_.min_lr_ratio + (1.0 - c_.min_lr_ratio) * cosine);
  }

 private:
  OptimConfig c_;
  int64_t total_;
};

class ConstantSchedule final : public Schedule {
 public:
  explicit ConstantSchedule(const OptimConfig& c) : c_(c) {}
  double lr(int64_t step) const override {
    if (step < c_.warmup_steps) return c_.lr * static_cast<double>(step + 1) / static_cast<double>(c_.warmup_steps);
    return c_.lr;
  }

 private:
  OptimConfig c_;
};

}  // namespace

ScheduleRegistry& schedule_registry() {
  static ScheduleRegistry* registry = [] {
    auto* r = new ScheduleRegistry("schedule");
    r->add("cosine", "linear warmup, cosine decay to lr * min_lr_ratio",
           [](const OptimConfig& c, int64_t total) { return std::make_unique<CosineSchedule>(c, total); });
    r->add("constant", "linear warmup, then constant",
           [](const OptimConfig& c, int64_t) { return std::make_unique<ConstantSchedule>(c); });
    return r;
  }();
  return *registry;
}

}  // namespace kiln

// AdamW with decoupled weight decay (as torch.optim.AdamW): p *= 1 - lr*wd, then the
// bias-corrected Adam update. State m, v per parameter in the optimizer arena, under
// torch's names (exp_avg, exp_avg_sq).
#include "ops/optim/adamw.h"
#include "train/optimizer_kinds.h"

#include <cmath>

namespace kiln {

namespace {

class AdamW final : public Optimizer {
 public:
  explicit AdamW(const OptimizerGroup& group)
      : index_(group.index), beta1_(group.beta1), beta2_(group.beta2), eps_(group.config->eps),
        weight_decay_(group.weight_decay) {
    for (const Parameter* p : group.parameters) slots_.push_back({p, Tensor(), Tensor()});
  }

  void plan(Arena& state) override {
    for (Slot& s : slots_) {
      state.reserve(s.m, s.param->value().dtype(), s.param->shape());
      state.reserve(s.v, s.param->value().dtype(), s.param->shape());
    }
  }

  void step(double lr) override {
    ++steps_;
    ops::adamw_update_all(tensors(), step_scalars(lr, steps_), table_);
  }

  int64_t steps_taken() const override { return steps_; }
  void set_steps_taken(int64_t steps) override { steps_ = steps; }

  bool updates_on_device() const override { return !slots_.empty() && slots_[0].param->value().device() == Device::cuda; }

  void prepare_device_update(double lr, ops::DeviceUpdateScalars& scalars) const override {
    const ops::AdamWStep step = step_scalars(lr, steps_ + 1);
    ops::GroupUpdateScalars& group = scalars.group[index_];
    group.lr = static_cast<float>(step.lr);
    group.bias_correction1 = static_cast<float>(step.bias_correction1);
    group.bias_correction2 = static_cast<float>(step.bias_correction2);
  }

  void step_on_device(const ops::DeviceUpdateScalars* scalars) override {
    ops::adamw_update_all_on_device(tensors(), step_scalars(0, steps_ + 1), scalars, index_, table_);
  }

  void count_update() override { ++steps_; }

  std::vector<OptimizerStateTensor> state_tensors() const override {
    std::vector<OptimizerStateTensor> out;
    for (const Slot& s : slots_) {
      out.push_back({s.param->name() + ".exp_avg", s.m});
      out.push_back({s.param->name() + ".exp_avg_sq", s.v});
    }
    return out;
  }

 private:
  struct Slot {
    const Parameter* param;
    Tensor m, v;
  };
  // The scalars of update number `update` (1-based: bias corrections 1 - beta^update).
  ops::AdamWStep step_scalars(double lr, int64_t update) const {
    ops::AdamWStep step;
    step.lr = lr;
    step.beta1 = beta1_;
    step.beta2 = beta2_;
    step.eps = eps_;
    step.bias_correction1 = 1.0 - std::pow(beta1_, static_cast<double>(update));
    step.bias_correction2 = 1.0 - std::pow(beta2_, static_cast<double>(update));
    return step;
  }

  const std::vector<ops::AdamWTensor>& tensors() {
    batch_.clear();
    for (const Slot& s : slots_) batch_.push_back({s.param->value(), s.param->grad(), s.m, s.v, weight_decay_});
    return batch_;
  }

  int index_;
  double beta1_, beta2_, eps_, weight_decay_;
  std::vector<Slot> slots_;
  std::vector<ops::AdamWTensor> batch_;  // reused each step: no allocation in the loop
  ops::AdamWDeviceTable table_;          // the GPU kernel's copy of batch_
  int64_t steps_ = 0;
};

}  // namespace

std::unique_ptr<Optimizer> make_adamw_optimizer(const OptimizerGroup& group) { return std::make_unique<AdamW>(group); }

}  // namespace kiln

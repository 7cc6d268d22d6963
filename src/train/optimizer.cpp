#include "train/optimizer.h"

#include "ops/elementwise/elementwise.h"
#include "ops/optim/adamw.h"

#include <cmath>

namespace kiln {

namespace {

// AdamW with decoupled weight decay (as torch.optim.AdamW): p *= 1 - lr*wd, then the
// bias-corrected Adam update. State m, v per parameter in the optimizer arena.
class AdamW final : public Optimizer {
 public:
  AdamW(const OptimConfig& config, const ParameterList& parameters) : config_(config) {
    for (const auto& p : parameters)
      if (p->trainable()) slots_.push_back({p.get(), Tensor(), Tensor(), applies_weight_decay(*p, config)});
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
    ops::GroupUpdateScalars& group = scalars.group[0];
    group.lr = static_cast<float>(step.lr);
    group.bias_correction1 = static_cast<float>(step.bias_correction1);
    group.bias_correction2 = static_cast<float>(step.bias_correction2);
  }

  void step_on_device(const ops::DeviceUpdateScalars* scalars) override {
    ops::adamw_update_all_on_device(tensors(), step_scalars(0, steps_ + 1), scalars, 0, table_);
  }

  void count_update() override { ++steps_; }

  // torch.optim.AdamW's names for m and v.
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
    bool decay;
  };
  // The scalars of update number `update` (1-based: bias corrections 1 - beta^update).
  ops::AdamWStep step_scalars(double lr, int64_t update) const {
    ops::AdamWStep step;
    step.lr = lr;
    step.beta1 = config_.beta1;
    step.beta2 = config_.beta2;
    step.eps = config_.eps;
    step.bias_correction1 = 1.0 - std::pow(config_.beta1, static_cast<double>(update));
    step.bias_correction2 = 1.0 - std::pow(config_.beta2, static_cast<double>(update));
    return step;
  }

  const std::vector<ops::AdamWTensor>& tensors() {
    batch_.clear();
    for (const Slot& s : slots_)
      batch_.push_back({s.param->value(), s.param->grad(), s.m, s.v, s.decay ? config_.weight_decay : 0.0});
    return batch_;
  }

  OptimConfig config_;
  std::vector<Slot> slots_;
  std::vector<ops::AdamWTensor> batch_;  // reused each step: no allocation in the loop
  ops::AdamWDeviceTable table_;          // the GPU kernel's copy of batch_
  int64_t steps_ = 0;
};

}  // namespace

void Optimizer::prepare_device_update(double, ops::DeviceUpdateScalars&) const {
  fail("optimizer", "this optimizer has no update with scalars in device memory");
}
void Optimizer::step_on_device(const ops::DeviceUpdateScalars*) {
  fail("optimizer", "this optimizer has no update with scalars in device memory");
}
void Optimizer::count_update() { fail("optimizer", "this optimizer has no update with scalars in device memory"); }

OptimizerRegistry& optimizer_registry() {
  static OptimizerRegistry* registry = [] {
    auto* r = new OptimizerRegistry("optimizer");
    r->add("adamw", "Adam with decoupled weight decay", [](const OptimConfig& c, const ParameterList& p) {
      return std::make_unique<AdamW>(c, p);
    });
    return r;
  }();
  return *registry;
}

bool applies_weight_decay(const Parameter& p, const OptimConfig& config) {
  if (p.name() == "embed.weight") return config.decay_embeddings;
  if (p.shape().rank() == 1) return config.decay_norms;
  return p.decay();
}

}  // namespace kiln

// The op-by-op executor of a step (train/step_executor.h): its scalars in host memory, each
// phase run as it comes. The CPU's step, and the GPU's with train.cuda_graphs = false.
//
// It clips by scaling the gradients before the update, where the captured executor hands
// the factor to the update; both follow ops/optim/step_rules.h, and this order is the one
// the CPU's golden loss curve and resume tests hold bit for bit.
#include "train/step_executor.h"

#include "core/error.h"

#include <optional>

namespace kiln {

namespace {

class OpByOpStep final : public StepExecutor {
 public:
  OpByOpStep(Model& model, Optimizer& optimizer, int64_t micro_batches, DataParallel* data_parallel)
      : model_(model), optimizer_(optimizer), micro_batches_(micro_batches), data_parallel_(data_parallel) {}

  void begin(int64_t targets, const StepPlan& plan) override {
    targets_ = targets;
    plan_ = plan;
    outcome_ = StepOutcome{};
    if (data_parallel_) data_parallel_->zero_gradients();  // ZeRO-2: its shard, the rest given back
    else model_.zero_grads();
  }

  int64_t load(size_t index, const HostBatch& batch) override {
    model_.load_batch(batch);
    last_micro_batch_ = static_cast<int64_t>(index) + 1 == micro_batches_;
    return 0;
  }

  void run(Part, int64_t, const std::function<void()>& work) override { work(); }

  void forward_backward() override {
    if (data_parallel_) data_parallel_->before_backward(last_micro_batch_);
    micro_sums_ = model_.forward_backward(plan_.loss_scale / static_cast<double>(targets_));
    if (data_parallel_) data_parallel_->after_backward();
  }

  void add_micro_sums() override {
    for (size_t k = 0; k < outcome_.step_sums.size(); ++k) outcome_.step_sums[k] += micro_sums_.slot[k];
  }

  void add_step_sums(const LossSlotSums& sums) override {
    for (size_t k = 0; k < outcome_.step_sums.size(); ++k) outcome_.step_sums[k] += sums[k];
  }

  void synchronize() override {
    if (!data_parallel_) return;
    data_parallel_->reduce_gradients();
    data_parallel_->sum(outcome_.step_sums.data(), static_cast<int64_t>(outcome_.step_sums.size()), Device::cpu);
  }

  void fault_hook(const StepProgram::FaultHook& hook) override {
    double loss = step_loss();
    hook(loss);
    loss_override_ = loss;
  }

  void gradient_norm() override {  // ZeRO-2: over every rank's shard (train/data_parallel.h)
    outcome_.grad_norm = (data_parallel_ ? data_parallel_->gradient_norm() : model_.gradient_norm()) / plan_.loss_scale;
  }

  void verdict_and_clip() override {
    outcome_.loss = loss_override_ ? *loss_override_ : step_loss();
    loss_override_.reset();
    outcome_.verdict = ops::step_verdict(outcome_.loss, outcome_.grad_norm, plan_.loss_limit, plan_.grad_limit);
    if (!outcome_.applied()) return;
    // Unscaled and clipped in one pass: 1 / S (exact, a power of two) times the clip's factor.
    double factor = 1 / plan_.loss_scale;
    if (ops::clip_applies(plan_.clip, outcome_.grad_norm)) factor *= ops::clip_factor(plan_.clip, outcome_.grad_norm);
    if (factor == 1) return;
    if (data_parallel_) data_parallel_->scale_gradients(factor);  // ZeRO-2: its shard
    else model_.scale_gradients(factor);
  }

  void update() override {
    if (!outcome_.applied()) return;
    optimizer_.step(plan_.lr);  // counts the update itself
    if (data_parallel_) data_parallel_->gather_parameters();  // ZeRO: the ranks' updated shards
  }

  StepOutcome finish() override { return outcome_; }

 private:
  double step_loss() const { return outcome_.step_sums[0] / static_cast<double>(targets_); }

  Model& model_;
  Optimizer& optimizer_;
  int64_t micro_batches_;
  DataParallel* data_parallel_;
  bool last_micro_batch_ = false;  // the loaded one is the step's last (its backward may reduce)
  int64_t targets_ = 0;
  StepPlan plan_;
  LossSums micro_sums_;
  StepOutcome outcome_;
  std::optional<double> loss_override_;  // the fault hook's loss, for this step only
};

}  // namespace

std::unique_ptr<StepExecutor> make_op_by_op_executor(Model& model, Optimizer& optimizer, int64_t micro_batches,
                                                     DataParallel* data_parallel) {
  return std::make_unique<OpByOpStep>(model, optimizer, micro_batches, data_parallel);
}

}  // namespace kiln

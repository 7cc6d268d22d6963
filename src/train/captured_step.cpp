// The captured executor of a step (train/step_executor.h), GPU only: the step's scalars in
// device memory (ops/optim/step_scalars.h) -- the loss scales the LM head and the router
// losses read, the loss sums they add, the norm, the verdict and the clip factor the finish
// kernel writes, the update's lr and skip flag -- so that every phase only enqueues work,
// a micro-batch and the update replay as CUDA graphs, and the host reads the scalars once,
// after the step. With model.moe.balance_scope = "step" each micro-batch's counting pass
// replays as a graph of its own too: the routed counts it adds stay in device memory, where
// the balance loss's kernels read them.
#include "train/step_executor.h"

#include "core/device_memory.h"
#include "core/error.h"
#include "ops/optim/step_scalars.h"

#include <algorithm>
#include <limits>
#include <optional>

#if KILN_WITH_CUDA
#include "core/step_graphs.h"
#endif

static_assert(kiln::ops::kStepLossSlots == kiln::kMaxLossSlots, "the captured step keeps every loss slot");

namespace kiln {

#if KILN_WITH_CUDA
namespace {

class CapturedStep final : public StepExecutor {
 public:
  CapturedStep(Model& model, Optimizer& optimizer, int64_t micro_batches, DataParallel* data_parallel)
      : model_(model),
        optimizer_(optimizer),
        micro_batches_(micro_batches),
        data_parallel_(data_parallel),
        host_scalars_(1),
        micro_graphs_("training micro-batch", model.exec()),
        update_graphs_("optimizer update", model.exec()),
        count_graphs_("route counting pass", model.exec()) {
    // One staged batch per micro-batch: a batch's pinned copy must stay untouched until
    // the stream has copied it, and the host stages the next while the GPU still runs.
    for (int64_t i = 0; i < micro_batches; ++i) staging_.emplace_back(static_cast<size_t>(model.staged_ints()));
    staged_.resize(static_cast<size_t>(micro_batches));
    device_scalars_ = Storage(Device::cuda, sizeof(ops::DeviceStepScalars));
    device_ = static_cast<ops::DeviceStepScalars*>(device_scalars_.data());
  }

  void begin(int64_t targets, const StepPlan& plan) override {
    ops::DeviceStepScalars& host = host_scalars_[0];
    host = ops::DeviceStepScalars{};
    host.targets = static_cast<double>(targets);
    host.loss_scale = static_cast<float>(plan.loss_scale / static_cast<double>(targets));
    host.scale = plan.loss_scale;
    host.loss_limit = plan.loss_limit;
    host.grad_limit = plan.grad_limit;
    host.clip = plan.clip;
    optimizer_.prepare_device_update(plan.lr, host.update);
    copy_to_device_async(model_.exec(), device_, &host, sizeof(host));
    model_.zero_grads();
    std::fill(staged_.begin(), staged_.end(), std::nullopt);
  }

  int64_t load(size_t index, const HostBatch& batch) override {
    int32_t* staging = staging_.at(index).data();
    // Loaded twice a step under the step balance scope (its counting pass, then its forward
    // and backward): staged once, since the stream may still be copying the first staging.
    std::optional<Model::StagedShape>& staged = staged_.at(index);
    if (!staged) staged = model_.stage_batch(batch, staging);
    const Model::StagedShape shape = *staged;
    model_.load_staged(staging, shape);
    // Under data parallelism a step's last micro-batch is a graph of its own: the buckets
    // reduce its gradients during its backward (train/data_parallel.h), and no other's.
    last_micro_batch_ = static_cast<int64_t>(index) + 1 == micro_batches_;
    const bool own_graph = data_parallel_ && last_micro_batch_;
    return own_graph ? shape.key() | std::numeric_limits<int64_t>::min() : shape.key();  // a key's sign bit is free
  }

  // Work replayed must be the same for every replay of a graph: fixed buffers, scalars
  // read from device memory.
  void run(Part part, int64_t key, const std::function<void()>& work) override {
    (part == Part::micro_batch ? micro_graphs_ : part == Part::update ? update_graphs_ : count_graphs_).run(key, work);
  }

  void forward_backward() override {
    if (data_parallel_) data_parallel_->before_backward(last_micro_batch_);
    model_.forward_backward_on_device(&device_->loss_scale, &device_->scale, device_->micro_sums);
    if (data_parallel_) data_parallel_->after_backward();  // a captured graph joins its branches here
  }
  void add_micro_sums() override { ops::add_micro_sums_on_device(model_.exec(), device_); }

  void synchronize() override {  // NCCL on the stream, inside the update's graph (the buckets: in the last micro-batch's)
    if (!data_parallel_) return;
    data_parallel_->reduce_gradients();
    data_parallel_->sum(device_->step_sums, ops::kStepLossSlots, Device::cuda);
  }

  void fault_hook(const StepProgram::FaultHook&) override {
    fail("train", "fault injection needs the op-by-op step (train.cuda_graphs = false)");
  }

  void gradient_norm() override {
    model_.gradient_sum_squares_to_device(&device_->grad_sum_squares);
    // ZeRO-2: this rank's shard's sum of squares, summed over the ranks on the stream.
    if (data_parallel_) data_parallel_->sum_shard_squares_on_device(&device_->grad_sum_squares);
  }
  // The loss, the norm, the guard's verdict and the update's skip flag and clip factor.
  void verdict_and_clip() override { ops::finish_step_on_device(model_.exec(), device_); }
  void update() override {
    optimizer_.step_on_device(&device_->update);
    // ZeRO: the ranks' updated shards (NCCL and copies on the stream); a skipped update
    // leaves every shard as it was, so gathering it changes nothing.
    if (data_parallel_) data_parallel_->gather_parameters();
  }

  StepOutcome finish() override {
    ops::DeviceStepScalars& host = host_scalars_[0];
    copy_to_host_async(model_.exec(), &host, device_, sizeof(host));
    if (data_parallel_) data_parallel_->watch_step();  // a lost rank ends the wait below
    synchronize_stream(model_.exec());  // the step's one wait
    StepOutcome outcome{host.loss, host.grad_norm, {}, host.verdict};
    std::copy(std::begin(host.step_sums), std::end(host.step_sums), outcome.step_sums.begin());
    // The device applied or skipped the update by the verdict; only now the host knows which.
    if (outcome.applied()) optimizer_.count_update();
    return outcome;
  }

  size_t graphs_captured() const override { return micro_graphs_.size() + update_graphs_.size() + count_graphs_.size(); }
  int64_t graph_launches() const override {
    return micro_graphs_.launches() + update_graphs_.launches() + count_graphs_.launches();
  }

 private:
  Model& model_;
  Optimizer& optimizer_;
  int64_t micro_batches_;
  DataParallel* data_parallel_;
  bool last_micro_batch_ = false;  // the loaded one is the step's last
  std::vector<PinnedArray<int32_t>> staging_;
  std::vector<std::optional<Model::StagedShape>> staged_;  // this step's, by micro-batch
  PinnedArray<ops::DeviceStepScalars> host_scalars_;
  Storage device_scalars_;
  ops::DeviceStepScalars* device_ = nullptr;
  cuda::StepGraphs micro_graphs_, update_graphs_, count_graphs_;
};

}  // namespace

std::unique_ptr<StepExecutor> make_captured_executor(Model& model, Optimizer& optimizer, int64_t micro_batches,
                                                     DataParallel* data_parallel) {
  // Before anything is allocated in pinned or device memory.
  KILN_CHECK(model.options().device == Device::cuda && model.options().training, "train",
             "the captured step needs a GPU training model");
  KILN_CHECK(optimizer.updates_on_device(), "train", "optimizer has no update with scalars in device memory");
  return std::make_unique<CapturedStep>(model, optimizer, micro_batches, data_parallel);
}
#else
std::unique_ptr<StepExecutor> make_captured_executor(Model&, Optimizer&, int64_t, DataParallel*) {
  fail("train", "the captured step needs the CUDA backend");
}
#endif

}  // namespace kiln

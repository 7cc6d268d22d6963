#include "train/device_step.h"

#include "core/error.h"
#include "core/phase_scope.h"

#include <algorithm>

static_assert(kiln::ops::kStepLossSlots == kiln::kMaxLossSlots, "the device step keeps every loss slot");

#if KILN_WITH_CUDA
#include "core/step_graphs.h"
#endif

namespace kiln {

DeviceStep::DeviceStep(Model& model, Optimizer& optimizer, int64_t micro_batches, bool graphs,
                       DataParallel* data_parallel)
    : model_(model), optimizer_(optimizer), data_parallel_(data_parallel), host_scalars_(1) {
  KILN_CHECK(model.options().device == Device::cuda && model.options().training, "train",
             "the device-side step needs a GPU training model");
  KILN_CHECK(optimizer.updates_on_device(), "train", "optimizer has no update with scalars in device memory");
  KILN_CHECK(micro_batches > 0, "train", "a step needs at least one micro-batch");
  for (int64_t i = 0; i < micro_batches; ++i)
    staging_.emplace_back(static_cast<size_t>(model.staged_ints()));
  device_scalars_ = Storage(Device::cuda, sizeof(ops::DeviceStepScalars));
#if KILN_WITH_CUDA
  if (graphs) {
    micro_graphs_ = std::make_shared<cuda::StepGraphs>("training micro-batch");
    update_graphs_ = std::make_shared<cuda::StepGraphs>("optimizer update");
  }
#else
  (void)graphs;
#endif
}

DeviceStep::~DeviceStep() = default;

#if KILN_WITH_CUDA
DeviceStepOutcome DeviceStep::run(const std::vector<HostBatch>& batches, int64_t targets, const DeviceStepPlan& plan) {
  KILN_CHECK(batches.size() == staging_.size(), "train", "{} micro-batches for a step planned with {}",
             batches.size(), staging_.size());
  KILN_CHECK(targets > 0, "train", "a step without target tokens");
  auto* device = static_cast<ops::DeviceStepScalars*>(device_scalars_.data());
  ops::DeviceStepScalars& host = host_scalars_[0];
  host = ops::DeviceStepScalars{};
  host.targets = static_cast<double>(targets);
  host.loss_scale = static_cast<float>(1.0 / static_cast<double>(targets));
  host.loss_limit = plan.loss_limit;
  host.grad_limit = plan.grad_limit;
  host.clip = plan.clip;
  optimizer_.prepare_device_update(plan.lr, host.update);
  copy_to_device_async(device, &host, sizeof(host));
  model_.zero_grads();

  // Work that must be the same for every replay of a graph: fixed buffers, scalars read
  // from device memory.
  auto micro_batch = [this, device] {
    model_.forward_backward_on_device(&device->loss_scale, device->micro_sums);
    ops::add_micro_sums_on_device(model_.exec(), device);
  };
  auto update = [this, device] {
    if (data_parallel_) {
      data_parallel_->reduce_gradients();
      data_parallel_->sum(device->step_sums, ops::kStepLossSlots, Device::cuda);
    }
    model_.gradient_sum_squares_to_device(&device->grad_sum_squares);
    {
      KILN_PHASE("guard and clip");  // the fault guard's verdict and the clip factor
      ops::finish_step_on_device(model_.exec(), device);
    }
    optimizer_.step_on_device(&device->update);
  };
  // Phases on the host: with graphs, a replayed micro-batch or update is one launch inside
  // its phase, and the phases within (forward, backward, ...) appear only when it runs op
  // by op.
  for (size_t i = 0; i < batches.size(); ++i) {
    KILN_PHASE("micro-batch");
    int32_t* staging = staging_[i].data();
    Model::StagedShape shape;
    {
      KILN_PHASE("load batch");
      shape = model_.stage_batch(batches[i], staging);
      model_.load_staged(staging, shape);
    }
    if (micro_graphs_) micro_graphs_->run(shape.key(), micro_batch);
    else micro_batch();
  }
  {
    KILN_PHASE("update");
    if (update_graphs_) update_graphs_->run(0, update);
    else update();
  }
  copy_to_host_async(&host, device, sizeof(host));
  synchronize_stream();  // the step's one wait
  DeviceStepOutcome outcome{host.loss, host.grad_norm, {}, host.verdict};
  std::copy(std::begin(host.step_sums), std::end(host.step_sums), outcome.step_sums.begin());
  return outcome;
}
#else
DeviceStepOutcome DeviceStep::run(const std::vector<HostBatch>&, int64_t, const DeviceStepPlan&) {
  fail("train", "the device-side step needs the CUDA backend");
}
#endif

size_t DeviceStep::graphs_captured() const {
#if KILN_WITH_CUDA
  if (micro_graphs_) return micro_graphs_->size() + update_graphs_->size();
#endif
  return 0;
}

int64_t DeviceStep::graph_launches() const {
#if KILN_WITH_CUDA
  if (micro_graphs_) return micro_graphs_->launches() + update_graphs_->launches();
#endif
  return 0;
}

}  // namespace kiln

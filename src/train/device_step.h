// One optimizer step on the GPU with no host synchronization inside it: the micro-batches'
// forward and backward, the global gradient norm, the fault guard's checks, the clip and
// the update all take their scalars from device memory (ops/optim/step_scalars.h), and
// the host reads the step's loss, gradient norm and verdict once, after it has run.
//
// With CUDA graphs on, each micro-batch's work replays as a captured graph, one per shape
// bucket of the staged batch (Model::stage_batch: the token budget, and the sequence count
// and longest sequence rounded up to powers of two), and the update as another. The first
// batch of a bucket runs op by op (the warm-up that builds cuBLASLt and cuDNN plans and
// sizes their workspaces), then is captured; later ones launch the graph.
#pragma once

#include "core/device_memory.h"
#include "core/tensor.h"
#include "data/batch.h"
#include "model/model.h"
#include "nn/loss_terms.h"
#include "ops/optim/step_scalars.h"
#include "train/data_parallel.h"
#include "train/optimizer.h"

#include <memory>
#include <vector>

namespace kiln {

namespace cuda {
class StepGraphs;
}

// What the host decides before a step.
struct DeviceStepPlan {
  double lr = 0;
  double loss_limit = 0, grad_limit = 0;  // the fault guard's spike limits (+inf: none)
  double clip = 0;                        // optim.grad_clip (0: off)
};

// What the host reads after it.
struct DeviceStepOutcome {
  double loss = 0, grad_norm = 0;  // mean main loss per target token; norm before the clip
  LossSlotSums step_sums{};        // every loss slot's sum over the step
  ops::StepVerdict verdict = ops::StepVerdict::apply;
};

class DeviceStep {
 public:
  // `micro_batches` per step (train.grad_accum); `graphs`: capture and replay CUDA graphs
  // (false: the same work op by op). `data_parallel` (null: one process) sums the
  // gradients and loss sums over the ranks before the norm: NCCL on the stream, inside the
  // update's graph.
  DeviceStep(Model& model, Optimizer& optimizer, int64_t micro_batches, bool graphs,
             DataParallel* data_parallel = nullptr);
  ~DeviceStep();
  DeviceStep(const DeviceStep&) = delete;
  DeviceStep& operator=(const DeviceStep&) = delete;

  // One step over `batches` (each filling the model's token budget) with `targets` target
  // tokens in all (over every rank). Zeroes the gradients first. The update is applied on the device unless
  // the verdict says skip; the caller then advances the optimizer's count
  // (Optimizer::count_update) only for an applied update.
  DeviceStepOutcome run(const std::vector<HostBatch>& batches, int64_t targets, const DeviceStepPlan& plan);

  // Micro-batch and update graphs captured so far, and steps' graph launches.
  size_t graphs_captured() const;
  int64_t graph_launches() const;

 private:
  Model& model_;
  Optimizer& optimizer_;
  DataParallel* data_parallel_;
  std::vector<PinnedArray<int32_t>> staging_;  // one staged batch per micro-batch of a step
  PinnedArray<ops::DeviceStepScalars> host_scalars_;
  Storage device_scalars_;
  // Null: op by op. shared_ptr: its deleter is made where one is created (CUDA builds),
  // so CPU builds, which lack StepGraphs' definition, never reference it.
  std::shared_ptr<cuda::StepGraphs> micro_graphs_, update_graphs_;
};

}  // namespace kiln

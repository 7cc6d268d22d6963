// One training step, written once (StepProgram::run): its phases in order --
//   with model.moe.balance_scope = "step" only: the counting pass (every micro-batch's
//     forward, the routed counts kept on the model's device, summed over the ranks; one
//     extra forward a step, a graph of its own per shape where graphs are captured);
//   per micro-batch: load the batch into the model's input buffers; forward, heads and
//     backward (gradients accumulate, each scaled by 1 / the step's target tokens); the
//     micro-batch's loss sums added to the step's, in order;
//   gradient synchronization over the ranks (data parallelism);
//   the global gradient norm; the fault guard's verdict and the clip (ops/optim/step_rules.h);
//   the optimizer update, unless the verdict skips it;
//   the update counted and the components' state between steps (Model::after_step).
// The trainer and `kiln bench` run steps through it, and read the loss, the gradient norm
// and the verdict once, after the step has run.
//
// How the phases execute is the executor's (train/step_executor.h), chosen once:
//   op by op: the step's scalars in host memory, each phase run as it comes (the host
//     reads the loss and the norm between them). The CPU's step, and the GPU's for debugging
//     (train.cuda_graphs = false).
//   captured: GPU only. The scalars in device memory (ops/optim/step_scalars.h), so nothing
//     is read until the step ends; each micro-batch replays as a CUDA graph, one per shape
//     bucket of the staged batch (Model::stage_batch), and the update as another. The first
//     batch of a bucket runs uncaptured (the warm-up that builds cuBLASLt and cuDNN plans and
//     sizes their workspaces), then is captured.
#pragma once

#include "data/batch.h"
#include "model/model.h"
#include "nn/loss_terms.h"
#include "ops/optim/step_rules.h"
#include "train/data_parallel.h"
#include "train/optimizer.h"

#include <functional>
#include <memory>
#include <vector>

namespace kiln {

// What the caller decides before a step.
struct StepPlan {
  double lr = 0;
  double loss_limit = 0, grad_limit = 0;  // the fault guard's spike limits (+inf: none)
  double clip = 0;                        // optim.grad_clip (0: off)
  // The loss scale S (train/loss_scaler.h), a power of two: the loss gradient is multiplied
  // by it and the gradients divided by it before the norm; 1: none.
  double loss_scale = 1;
};

// What it reads after the step.
struct StepOutcome {
  double loss = 0, grad_norm = 0;  // mean main loss per target token; norm before the clip (unscaled)
  LossSlotSums step_sums{};        // every loss slot's sum over the step (over every rank)
  ops::StepVerdict verdict = ops::StepVerdict::apply;
  bool applied() const { return verdict == ops::StepVerdict::apply; }
};

enum class StepExecution { op_by_op, captured };

// Captured where it can run -- a GPU model, train.cuda_graphs, an optimizer whose update
// reads its scalars from device memory -- else op by op.
StepExecution choose_step_execution(Device device, bool cuda_graphs, const Optimizer& optimizer);
const char* step_execution_name(StepExecution execution);  // "CUDA graphs" / "op by op"

class StepExecutor;

class StepProgram {
 public:
  // `micro_batches` per step (train.grad_accum). `data_parallel` (null: one process) sums
  // the gradients and the loss sums over the ranks before the norm.
  StepProgram(Model& model, Optimizer& optimizer, int64_t micro_batches, StepExecution execution,
              DataParallel* data_parallel = nullptr);
  ~StepProgram();
  StepProgram(const StepProgram&) = delete;
  StepProgram& operator=(const StepProgram&) = delete;

  // Tests only (KILN_FAULT_INJECT's numeric faults): called after the gradient
  // synchronization and before the norm with the step's loss, which it may change, as it
  // may the gradients. Op by op only: captured work cannot stop for the host.
  using FaultHook = std::function<void(double& loss)>;
  void set_fault_hook(FaultHook hook);

  // Runs the step's micro-batches' forward and backward in place of one after another (the
  // pipeline's schedule, train/pipeline_trainer_step.h): gradients accumulated into the
  // model's, each scaled by `gradient_scale`; returns the step's loss sums (this rank's
  // share, summed over the ranks with the gradients). Op by op only.
  using MicroBatchRunner = std::function<LossSlotSums(const std::vector<HostBatch>& batches, double gradient_scale)>;
  void set_micro_batch_runner(MicroBatchRunner runner);

  // One step over `batches` (each filling the model's token budget) with `targets` target
  // tokens in all (over every rank). Zeroes the gradients first; applies the update unless
  // the verdict skips it, and then counts it (Optimizer::steps_taken); tells the model's
  // components whether it was applied.
  StepOutcome run(const std::vector<HostBatch>& batches, int64_t targets, const StepPlan& plan);

  StepExecution execution() const { return execution_; }
  // Micro-batch and update graphs captured so far, and the graph launches of the steps run
  // (0 op by op).
  size_t graphs_captured() const;
  int64_t graph_launches() const;

 private:
  Model& model_;
  // model.moe.balance_scope = "step": the counting pass over the step's batches, and the
  // counts summed over the ranks, before the first micro-batch's forward and backward.
  void count_step_routes(StepExecutor& step, const std::vector<HostBatch>& batches);

  int64_t micro_batches_;
  StepExecution execution_;
  DataParallel* data_parallel_;
  FaultHook fault_hook_;
  MicroBatchRunner micro_batch_runner_;
  std::unique_ptr<StepExecutor> executor_;
};

}  // namespace kiln

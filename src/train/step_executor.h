// How a StepProgram's phases run (train/step_program.h): where the step's scalars live
// (host or device memory) and whether the work replays as CUDA graphs. StepProgram::run
// calls the phases in their order; an executor implements each one and never decides
// their order.
#pragma once

#include "train/step_program.h"

#include <cstdint>
#include <functional>
#include <memory>

namespace kiln {

class StepExecutor {
 public:
  // The units of work an executor may capture and replay: one micro-batch's, the update's
  // (synchronization, norm, verdict and clip, update), and one micro-batch's counting pass
  // (model.moe.balance_scope = "step": its forward with only the routed counts kept).
  enum class Part { micro_batch, update, count_routes };

  virtual ~StepExecutor() = default;

  // The step's scalars (targets, limits, clip, the optimizer's lr) set, the gradients zeroed.
  virtual void begin(int64_t targets, const StepPlan& plan) = 0;
  // Loads micro-batch `index` of the step into the model's input buffers; returns the key of
  // its shape (the graph it replays as, where graphs are captured).
  virtual int64_t load(size_t index, const HostBatch& batch) = 0;
  // `work` (the phases of `part`) as it is, or replayed as the graph captured for `key`.
  virtual void run(Part part, int64_t key, const std::function<void()>& work) = 0;

  // The phases, in StepProgram::run's order.
  virtual void forward_backward() = 0;        // the loaded micro-batch: forward, heads, backward
  virtual void add_micro_sums() = 0;          // its loss sums into the step's
  // Instead of the two above: loss sums of micro-batches run elsewhere (a micro-batch
  // runner, StepProgram::set_micro_batch_runner) into the step's. Op by op only.
  virtual void add_step_sums(const LossSlotSums& sums);
  virtual void synchronize() = 0;             // gradients and loss sums over the ranks
  virtual void fault_hook(const StepProgram::FaultHook& hook) = 0;  // tests only
  virtual void gradient_norm() = 0;           // the global norm (its sum of squares)
  virtual void verdict_and_clip() = 0;        // the loss; the guard's verdict; the clip
  virtual void update() = 0;                  // the optimizer's, unless the verdict skips it
  // The step's outcome, read once it has run; an applied update counted.
  virtual StepOutcome finish() = 0;

  virtual size_t graphs_captured() const { return 0; }
  virtual int64_t graph_launches() const { return 0; }
};

// The two executors (op_by_op_step.cpp, captured_step.cpp).
std::unique_ptr<StepExecutor> make_op_by_op_executor(Model& model, Optimizer& optimizer, int64_t micro_batches,
                                                     DataParallel* data_parallel);
std::unique_ptr<StepExecutor> make_captured_executor(Model& model, Optimizer& optimizer, int64_t micro_batches,
                                                     DataParallel* data_parallel);

}  // namespace kiln

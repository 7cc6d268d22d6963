#include "train/step_program.h"

#include "core/error.h"
#include "core/phase_scope.h"
#include "train/step_executor.h"

namespace kiln {

StepExecution choose_step_execution(Device device, bool cuda_graphs, const Optimizer& optimizer) {
  return device == Device::cuda && cuda_graphs && optimizer.updates_on_device() ? StepExecution::captured
                                                                                : StepExecution::op_by_op;
}

const char* step_execution_name(StepExecution execution) {
  return execution == StepExecution::captured ? "CUDA graphs" : "op by op";
}

void StepExecutor::add_step_sums(const LossSlotSums&) {
  fail("train", "this step executor takes its loss sums micro-batch by micro-batch only");
}

StepProgram::StepProgram(Model& model, Optimizer& optimizer, int64_t micro_batches, StepExecution execution,
                         DataParallel* data_parallel)
    : model_(model), micro_batches_(micro_batches), execution_(execution), data_parallel_(data_parallel) {
  KILN_CHECK(micro_batches > 0, "train", "a step needs at least one micro-batch");
  executor_ = execution == StepExecution::captured
                  ? make_captured_executor(model, optimizer, micro_batches, data_parallel)
                  : make_op_by_op_executor(model, optimizer, micro_batches, data_parallel);
}

StepProgram::~StepProgram() = default;

void StepProgram::set_fault_hook(FaultHook hook) {
  KILN_CHECK(execution_ == StepExecution::op_by_op || !hook, "train",
             "fault injection needs the op-by-op step (train.cuda_graphs = false)");
  fault_hook_ = std::move(hook);
}

void StepProgram::set_micro_batch_runner(MicroBatchRunner runner) {
  KILN_CHECK(execution_ == StepExecution::op_by_op || !runner, "train",
             "a micro-batch runner (the pipeline) needs the op-by-op step");
  KILN_CHECK(!model_.counts_step_routes() || !runner, "model.moe.balance_scope",
             "'step' needs every micro-batch's forward before the first backward: not with a micro-batch runner");
  micro_batch_runner_ = std::move(runner);
}

StepOutcome StepProgram::run(const std::vector<HostBatch>& batches, int64_t targets, const StepPlan& plan) {
  KILN_CHECK(static_cast<int64_t>(batches.size()) == micro_batches_, "train",
             "{} micro-batches for a step planned with {}", batches.size(), micro_batches_);
  KILN_CHECK(targets > 0, "train", "a step without target tokens");
  StepExecutor& step = *executor_;
  model_.set_loss_scale(plan.loss_scale);  // the router losses' (the captured step reads its own copy)
  step.begin(targets, plan);
  if (model_.counts_step_routes()) count_step_routes(step, batches);
  // Phases on the host: where work replays as a graph, a micro-batch or the update is one
  // launch inside its phase, and the phases within (forward, backward, ...) appear only when
  // it runs uncaptured.
  if (micro_batch_runner_) {
    KILN_PHASE("micro-batches");
    step.add_step_sums(micro_batch_runner_(batches, plan.loss_scale / static_cast<double>(targets)));
  }
  for (size_t i = 0; i < batches.size() && !micro_batch_runner_; ++i) {
    KILN_PHASE("micro-batch");
    int64_t key = 0;
    {
      KILN_PHASE("load batch");
      key = step.load(i, batches[i]);
    }
    step.run(StepExecutor::Part::micro_batch, key, [&step] {
      step.forward_backward();
      step.add_micro_sums();
    });
  }
  {
    KILN_PHASE("update");
    step.run(StepExecutor::Part::update, 0, [this, &step] {
      step.synchronize();
      if (fault_hook_) step.fault_hook(fault_hook_);
      step.gradient_norm();
      {
        KILN_PHASE("guard and clip");
        step.verdict_and_clip();
      }
      step.update();
    });
  }
  const StepOutcome outcome = step.finish();
  model_.after_step(outcome.applied());
  if (model_.counts_step_routes()) model_.clear_step_routes();  // a forward outside a step has none
  return outcome;
}

// model.moe.balance_scope = "step": the balance loss's f_i are the whole step's, and each
// micro-batch's backward needs them, so they are counted first: the forward of every
// micro-batch (one extra forward per step; its routes are the training pass's, the weights
// unchanged until the update), then the counts summed over the ranks.
void StepProgram::count_step_routes(StepExecutor& step, const std::vector<HostBatch>& batches) {
  KILN_PHASE("count routes");
  model_.clear_step_routes();
  for (size_t i = 0; i < batches.size(); ++i) {
    const int64_t key = step.load(i, batches[i]);
    step.run(StepExecutor::Part::count_routes, key, [this] { model_.count_step_routes(); });
  }
  if (!data_parallel_) return;
  for (Tensor* counts : model_.step_routes()) data_parallel_->sum(counts->data<double>(), counts->numel(), counts->device());
}

size_t StepProgram::graphs_captured() const { return executor_->graphs_captured(); }
int64_t StepProgram::graph_launches() const { return executor_->graph_launches(); }

}  // namespace kiln

// The training loop: packed micro-batches -> forward/backward with token-exact gradient
// accumulation -> fault guard -> clip -> optimizer -> schedule, with validation, samples,
// console progress, the run's records (a JSONL metrics file, TensorBoard event files), and
// resumable checkpoints (periodic, at the end, and on SIGTERM/SIGINT).
#pragma once

#include "data/batch_stream.h"
#include "data/tokenizer.h"
#include "model/model.h"
#include "train/checkpoint.h"
#include "train/console.h"
#include "train/data_parallel.h"
#include "train/pipeline_trainer_step.h"
#include "config/config.h"
#include "core/device_choice.h"
#include "train/fault_guard.h"
#include "train/loss_scaler.h"
#include "train/fault_inject.h"
#include "train/init_from.h"
#include "train/metrics.h"
#include "train/optimizer.h"
#include "train/run_directory.h"
#include "train/run_records.h"
#include "train/run_summary.h"
#include "train/schedules.h"
#include "train/step_program.h"
#include "train/training_build.h"
#include "train/training_evaluator.h"
#include "train/training_sampler.h"

#include <memory>
#include <optional>
#include <vector>

namespace kiln {

class StopSignals;

struct TrainOptions {
  // "" = a fresh run; "latest" = the newest checkpoint in checkpoint.dir (a fresh run,
  // with a notice, when there is none yet); anything else names a checkpoint or a
  // checkpoint directory.
  std::string resume;
  bool allow_data_change = false;  // resume although the data fingerprint changed
  // A fresh run into a directory holding an earlier run removes that run's files
  // (otherwise it is refused); not with `resume`.
  bool overwrite = false;
};

struct TrainResult {
  int64_t steps = 0;
  double final_train_loss = 0;
  double final_val_loss = 0;  // nats per token; NaN when there is no validation split
  double seconds = 0;
  int64_t skipped_steps = 0;   // updates skipped by the fault guard
  std::string stopped_by;      // "SIGTERM" / "SIGINT" when a signal ended the run (or its end) early
  std::string checkpoint;      // the last checkpoint written, if any
};

class Trainer {
 public:
  explicit Trainer(const Config& config, const TrainOptions& options = {});
  ~Trainer();

  TrainResult run();
  // Mean loss over the cached validation batches (nats per target token); NaN when there
  // are none, or when a stop signal cut the pass short.
  double validate();
  // train.sample_prompt and its continuation; nullopt when sampling is off
  // (train.sample_tokens = 0) or a stop signal cut the sample short.
  std::optional<std::string> sample(uint64_t seed);
  Model& model() { return *model_; }
  // Steps (micro-batches and updates) that ran as captured CUDA graphs so far.
  int64_t graph_launches() const { return step_->graph_launches(); }

 private:
  // One step; false when the fault guard skipped its update.
  bool step(int64_t step_index, StepMetrics& metrics);
  bool skip_update(const StepMetrics& m);  // reports and counts a skipped update; false
  void log_step(const StepMetrics& m);
  // The live progress line after step m (a terminal only): `step_seconds` that step's time.
  void show_progress(const StepMetrics& m, double step_seconds, double elapsed);
  // Model FLOPs utilization per GPU at `tokens_per_second` (every rank's tokens); NaN on the
  // CPU, which has no known peak.
  double mfu(double tokens_per_second) const;
  // The GPU's memory in use (cudaMemGetInfo: every process on it, as kiln bench reports
  // it); 0 on the CPU.
  int64_t device_memory_used_bytes() const;
  std::vector<std::pair<std::string, double>> reported_terms(const LossSlotSums& sums, int64_t targets) const;
  // Validation and a sample at `step`, printed and recorded; NaN when there is no
  // validation set.
  double show_validation(int64_t step);
  void show_sample(int64_t step);
  // The [eval] suite at `step`, printed and recorded (nothing when a stop cut it short).
  void show_eval(int64_t step);
  // After the last step: saves the model and the final checkpoint, then validates and
  // samples. Nothing after the save can lose the run: a stop signal ends the validation or
  // sample early (exit 0), a failing one is a warning. `export_due`: the last step is one
  // of the export's cadence (the schedule leaves it to the end, after the final save).
  void finish(TrainResult& result, bool export_due);
  void write_summary(const TrainResult& result) const;
  void keep_if_best(int64_t step, TrainResult& result);
  // checkpoint.export_hf_every: a stock Hugging Face export of `step`'s checkpoint (saved
  // now unless one of this step exists) into <out_dir>/hf/step-N; a failure warns.
  void export_hf_at(int64_t step, TrainResult& result);
  // A SIGTERM/SIGINT arrived while run() is running (several ranks: the signal they
  // agreed on at the last step boundary, so every rank stops at the same point).
  bool stop_requested() const;
  int stop_signal() const;
  // At a step boundary: the signal received here, or by any rank.
  int agree_on_stop();
  // This process writes the run's files (config, metrics, checkpoints, the model): a
  // single process, or rank 0 of several.
  bool writes_files() const { return !group_ || group_->is_root(); }
  // Micro-batches of one step over every rank (the per-micro-batch loss terms' divisor).
  int64_t micro_batches_per_step() const { return config_.train.grad_accum * data_ranks(); }
  // The ranks that read micro-batches of their own: the group's, or with a pipeline its
  // replicas (a replica's stages read the same micro-batches; train/pipeline_trainer_step.h).
  int64_t data_ranks() const {
    if (!group_) return 1;
    return pipelined(config_) ? group_->world_size() / config_.dist.pipeline_stages : group_->world_size();
  }
  // This rank's place among them: its rank, or its pipeline replica's.
  int64_t data_rank() const {
    if (!group_) return 0;
    return pipelined(config_) ? pipeline_layout(config_, group_->world_size()).replica_of(group_->rank())
                              : group_->rank();
  }
  // Joins the launcher's ranks, if it started several (before anything else is made).
  void join_process_group();

  // trainer_checkpoint.cpp: the glue between the loop and train/checkpoint.h.
  std::optional<CheckpointInfo> find_resume_checkpoint(const TrainOptions& options);
  void restore(const CheckpointInfo& checkpoint, bool allow_data_change);
  // train.init_from: the source's weights into the allocated model (train/init_from.h).
  void start_from(const InitialWeights& source);
  // On resume at another process count: train.grad_accum set so that a step takes the
  // checkpoint's tokens, or an error naming it when none can.
  void keep_global_batch(const CheckpointInfo& checkpoint);
  // Rank 0, before the run's first write: --overwrite's removal, then DIR/run_id.
  void claim_run_directory(const TrainOptions& options);
  CheckpointState checkpoint_state() const;
  std::string save_checkpoint();
  // A periodic or final save; a failure stops the run or warns (checkpoint.on_save_error).
  void save_checkpoint_or_warn(TrainResult& result);

  Config config_;
  Console console_;
  Device device_;
  std::unique_ptr<dist::ProcessGroup> group_;      // null: a single process
  std::unique_ptr<DataParallel> data_parallel_;    // with the group, once the model exists
  int agreed_signal_ = 0;                          // the ranks' agreed stop signal
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<TokenDataset> dataset_;
  std::unique_ptr<BatchStream> stream_;
  std::vector<HostBatch> micro_batches_;  // one step's worth, reused every step
  std::vector<HostBatch> validation_;
  // A mixture: each validation batch's source (data.sources index), and the last pass's
  // loss per source, recorded as a "validation_sources" record; empty for one source.
  std::vector<int32_t> validation_sources_;
  NamedValues source_validation_;
  std::unique_ptr<Model> model_;
  Arena optimizer_state_;
  std::unique_ptr<Optimizer> optimizer_;
  std::unique_ptr<Schedule> schedule_;
  std::unique_ptr<PipelineTrainerStep> pipeline_;  // dist.pipeline_stages > 1: the step's micro-batches
  std::unique_ptr<StepProgram> step_;  // one step's phases, op by op or captured
  RunRecords records_;  // rank 0: metrics.jsonl and TensorBoard; other ranks record nothing
  std::unique_ptr<TrainingSampler> sampler_;  // null when train.sample_tokens = 0
  // A pipeline of stage models: rank 0's whole model for sampling and the evaluation suite
  // (an inference build, its weights gathered from the stages before each use); null
  // elsewhere, and without either.
  std::unique_ptr<Model> whole_model_;
  // Every rank sends its stages' weights to rank 0's whole model (all ranks call it at once;
  // a no-op without stage models).
  void gather_whole_model();
  std::unique_ptr<TrainingEvaluator> evaluator_;  // null when [eval] names no task or text

  FaultInjector faults_;        // test-only (KILN_FAULT_INJECT); empty otherwise
  FaultGuard guard_;
  LossScaler scaler_;  // train.loss_scale
  TrainProgress progress_;      // everything the loop carries from step to step
  std::unique_ptr<CheckpointWriter> checkpoints_;
  std::unique_ptr<RunDirectory> run_dir_;  // rank 0: locked for the run's lifetime
  std::string run_id_;                     // recorded in every checkpoint
  int64_t checkpoint_step_ = -1;  // step of the checkpoint last saved or resumed from
  int threads_ = 0;
  const StopSignals* signals_ = nullptr;  // installed by run() for its duration
  double run_start_ = 0;                  // run()'s clock origin (a resumed run continues it)
  // This run's own start (its clock and the tokens done before it), for summary.json.
  double this_run_start_ = 0;
  int64_t tokens_before_run_ = 0, document_tokens_before_run_ = 0;
  BestValidation best_validation_;         // of every run so far (a resume reads the earlier runs')
  double last_validation_ = std::nan("");  // for the progress line
  // The last progress line's step, to draw it again when a validation changes its "val".
  struct ProgressPoint {
    StepMetrics metrics;
    double step_seconds = 0, elapsed = 0;
  };
  std::optional<ProgressPoint> last_progress_;
};

}  // namespace kiln

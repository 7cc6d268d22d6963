// The training loop: packed micro-batches -> forward/backward with token-exact gradient
// accumulation -> fault guard -> clip -> optimizer -> schedule, with validation, samples,
// console progress, a JSONL metrics file, and resumable checkpoints (periodic, at the
// end, and on SIGTERM/SIGINT).
#pragma once

#include "data/batch_stream.h"
#include "data/tokenizer.h"
#include "model/model.h"
#include "train/checkpoint.h"
#include "config/config.h"
#include "train/device_step.h"
#include "train/fault_guard.h"
#include "train/fault_inject.h"
#include "train/metrics.h"
#include "train/optimizer.h"

#include <memory>
#include <optional>
#include <vector>

namespace kiln {

struct TrainOptions {
  // "" = a fresh run; "latest" = the newest checkpoint in checkpoint.dir (a fresh run,
  // with a notice, when there is none yet); anything else names a checkpoint or a
  // checkpoint directory.
  std::string resume;
  bool allow_data_change = false;  // resume although the data fingerprint changed
};

struct TrainResult {
  int64_t steps = 0;
  double final_train_loss = 0;
  double final_val_loss = 0;  // nats per token; NaN when there is no validation split
  double seconds = 0;
  int64_t skipped_steps = 0;   // updates skipped by the fault guard
  std::string stopped_by;      // "SIGTERM" / "SIGINT" when a signal ended the run early
  std::string checkpoint;      // the last checkpoint written, if any
};

class Trainer {
 public:
  explicit Trainer(const Config& config, const TrainOptions& options = {});
  ~Trainer();

  TrainResult run();
  // Mean loss over the cached validation batches (nats per target token).
  double validate();
  std::string sample(uint64_t seed);
  Model& model() { return *model_; }
  // Steps (micro-batches and updates) that ran as captured CUDA graphs so far.
  int64_t graph_launches() const { return device_step_ ? device_step_->graph_launches() : 0; }

 private:
  // One step; false when the fault guard skipped its update.
  bool step(int64_t step_index, StepMetrics& metrics);
  bool skip_update(const StepMetrics& m);  // reports and counts a skipped update; false
  void log_step(const StepMetrics& m);
  std::vector<std::pair<std::string, double>> reported_terms(const LossSlotSums& sums, int64_t targets) const;

  // trainer_checkpoint.cpp: the glue between the loop and train/checkpoint.h.
  std::optional<CheckpointInfo> find_resume_checkpoint(const TrainOptions& options);
  void restore(const CheckpointInfo& checkpoint, bool allow_data_change);
  CheckpointState checkpoint_state() const;
  std::string save_checkpoint();
  // A periodic or final save; a failure stops the run or warns (checkpoint.on_save_error).
  void save_checkpoint_or_warn(TrainResult& result);

  Config config_;
  Device device_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<TokenDataset> dataset_;
  std::unique_ptr<BatchStream> stream_;
  std::vector<HostBatch> micro_batches_;  // one step's worth, reused every step
  std::vector<HostBatch> validation_;
  std::unique_ptr<Model> model_;
  Arena optimizer_state_;
  std::unique_ptr<Optimizer> optimizer_;
  std::unique_ptr<Schedule> schedule_;
  std::unique_ptr<DeviceStep> device_step_;  // the GPU's step (null: the op-by-op loop)
  std::unique_ptr<MetricsLog> metrics_;

  FaultInjector faults_;        // test-only (KILN_FAULT_INJECT); empty otherwise
  FaultGuard guard_;
  TrainProgress progress_;      // everything the loop carries from step to step
  std::unique_ptr<CheckpointWriter> checkpoints_;
  int64_t checkpoint_step_ = -1;  // step of the checkpoint last saved or resumed from
  int threads_ = 0;
};

// Resolves train.device ("auto" picks CUDA only where the CUDA training path exists).
Device resolve_device(const std::string& setting);
// train.precision on that device: the compute dtype of BuildOptions.
DType resolve_precision(const std::string& setting, Device device);
// The model build of a training run of `config` on `device` (what train, bench, plan and
// the memory check all build): precision, token budget, loss chunk, recompute, determinism.
BuildOptions training_build_options(const Config& config, Device device);

}  // namespace kiln

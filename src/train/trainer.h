// The training loop: packed micro-batches -> forward/backward with token-exact gradient
// accumulation -> clip -> optimizer -> schedule, with validation, samples, console
// progress and a JSONL metrics file.
#pragma once

#include "data/batch_stream.h"
#include "data/tokenizer.h"
#include "model/model.h"
#include "train/config.h"
#include "train/metrics.h"
#include "train/optimizer.h"

#include <memory>
#include <vector>

namespace kiln {

struct TrainResult {
  int64_t steps = 0;
  double final_train_loss = 0;
  double final_val_loss = 0;  // nats per token; NaN when there is no validation split
  double seconds = 0;
};

class Trainer {
 public:
  explicit Trainer(const Config& config);
  ~Trainer();

  TrainResult run();
  // Mean loss over the cached validation batches (nats per target token).
  double validate();
  std::string sample(uint64_t seed);
  Model& model() { return *model_; }

 private:
  void step(int64_t step_index, StepMetrics& metrics);
  void log_step(const StepMetrics& m);

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
  std::unique_ptr<MetricsLog> metrics_;
};

// Resolves train.device ("auto" picks CUDA only where the CUDA training path exists).
Device resolve_device(const std::string& setting);

}  // namespace kiln

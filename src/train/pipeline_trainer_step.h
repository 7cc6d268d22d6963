// The trainer's pipeline (dist.pipeline_stages > 1; docs/distributed.md, "Training with a
// pipeline"), first step of issue 46, on the CPU over Gloo:
// - Every rank reads the whole step's micro-batches (train.grad_accum of them, the data
//   stream unsharded) and runs its stages of them through the schedule
//   (train/pipeline_engine.h) with kiln's model cut into stages (train/pipeline_model_stage.h).
// - Every rank builds the whole model and accumulates gradients only for its stages'
//   layers; the step's one all-reduce (sum) of the gradients (DataParallel::reduce_gradients,
//   with no buckets) then gives every rank the whole gradient -- its other parameters' are
//   zero there, and x + 0 is exact -- and the loss sums (the main loss only on the last
//   stage). Every rank so takes the same norm, guard, clip and optimizer update, and holds
//   the same whole model after the step: a full replica, memory saved by nothing yet.
// - So validation runs as under data parallelism (each rank its share of the batches, the
//   sums added), and rank 0 writes an ordinary checkpoint, which resumes in one process,
//   under data parallelism or with another split.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "config/config.h"
#include "data/batch.h"
#include "dist/communicator.h"
#include "model/model.h"
#include "nn/loss_terms.h"
#include "train/pipeline_schedule.h"

namespace kiln {

inline bool pipelined(const Config& config) { return config.dist.pipeline_stages > 1; }

// The dist.pipeline_* keys against the rest of the config, `world_size` ranks and the
// training device, before anything is read or allocated: one line naming the key. With the
// pipeline off, only that its other keys are left at their defaults.
void check_pipeline_config(const Config& config, int world_size, Device device);

// The data config the training stream reads: the config's, or with the pipeline on, one
// reader of the whole stream (data.world_size = 1) on every rank.
DataConfig pipeline_data_config(const Config& config);

// The stages' first layers, and the schedule for `ranks` ranks, as the config asks
// (dist.pipeline_split, else planned from the config's estimated per-layer costs).
std::vector<int64_t> pipeline_bounds(const Config& config);
pipeline::Schedule pipeline_schedule(const Config& config, int ranks);

class PipelineTrainerStep {
 public:
  PipelineTrainerStep(const Config& config, Model& model, dist::Communicator& comm);

  // The forward and backward of the step's micro-batches through this rank's stages,
  // gradients accumulated into the model's (each scaled by `gradient_scale`, as
  // Model::forward_backward's); returns this rank's share of the step's loss sums,
  // micro-batch after micro-batch. Summed over the ranks with the gradients (StepProgram).
  LossSlotSums run(const std::vector<HostBatch>& batches, double gradient_scale);

  // "pipeline: 2 stages on 2 ranks (1f1b, 4 micro-batches a step), layers 0..3, 4..7; this rank
  // runs stage 1; every rank keeps the whole model"
  std::string describe() const;

 private:
  Model& model_;
  dist::Communicator& comm_;
  const std::vector<int64_t> bounds_;  // first layer of each stage, then model.layers
  const pipeline::Schedule schedule_;
};

}  // namespace kiln

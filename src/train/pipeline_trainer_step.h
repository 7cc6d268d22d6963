// The trainer's pipeline (dist.pipeline_stages > 1; docs/distributed.md, "Training with a
// pipeline"), first step of issue 46, on the CPU over Gloo:
// - W = stages x D ranks form D pipelines, the replicas (train/pipeline_layout.h: stage =
//   rank / D, replica = rank % D). Every rank of a replica reads that replica's share of the
//   stream (data rank = replica, data world = D, as data parallelism shards it):
//   train.grad_accum micro-batches a step, which it runs through its stages on the schedule
//   (train/pipeline_engine.h, its sends within the replica) with kiln's model cut into
//   stages (train/pipeline_model_stage.h).
// - With dist.pipeline_model = "stages", each rank builds only its stages' layers
//   (BuildOptions::layers: the embedding on the first stage, and on the last with a tied
//   head; the final norm and head on the last), so its parameters, gradients, optimizer
//   state and activation frames are its stages' alone. The step's gradients are summed
//   per stage over its D replicas (a communicator of the stage's ranks), and a tied
//   table's two shares swapped between the first and the last stage's ranks
//   (train/stage_gradients.h); the norm sums the ranks' parts, the loss sums are added over
//   the ranks as below.
//   Validation runs each batch through the stages, forward only (evaluate()); a checkpoint
//   gathers replica 0's weights to rank 0, which writes the whole model's model.safetensors,
//   and each of replica 0's ranks writes its optimizer state to a file of its own (the
//   other replicas' files are empty: they hold the same state; train/stage_weights.h), so
//   it resumes in one process, under data parallelism or at another split, and a whole
//   model's checkpoint resumes here. Rank 0 samples and runs the evaluation suite on a
//   whole model of its own whose weights the stages send it (gather_weights). Rank 0's log
//   gathers every stage's component metrics. ZeRO is refused, naming the key.
// - With "whole" (the default), every rank builds the whole model and accumulates gradients only for its stages'
//   layers; the step's one all-reduce (sum) of the gradients over all W ranks
//   (DataParallel::reduce_gradients, with no buckets) then gives every rank the whole
//   gradient summed over the replicas -- its other stages' parameters are zero there, and
//   x + 0 is exact -- and the loss sums (the main loss only on the last stages). A tied
//   head's table is the one parameter two stages add to (the lookup on the first, the head
//   on the last): the same all-reduce sums their two shares, so every rank holds the
//   table's whole gradient, once, with no exchange of its own. Every rank
//   so takes the same norm, guard, clip and optimizer update, and holds the same whole
//   model after the step: a full replica of the parameters. dist.zero = 1 or 2 shards the
//   optimizer state (and gradients) over all W ranks as under data parallelism: the sum
//   (or reduce-scatter) over every rank gives each shard its summed gradient. The
//   pipeline's transfers run on a communicator of their own (ProcessGroup::pipeline).
// - So validation runs as under data parallelism (each rank its share of the batches, the
//   sums added), and rank 0 writes an ordinary checkpoint, which resumes in one process,
//   under data parallelism or with another split.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "config/config.h"
#include "data/batch.h"
#include "dist/communicator.h"
#include "model/model.h"
#include "nn/loss_terms.h"
#include "train/pipeline_layout.h"
#include "train/pipeline_schedule.h"
#include "train/stage_gradients.h"
#include "train/stage_weights.h"

namespace kiln {

inline bool pipelined(const Config& config) { return config.dist.pipeline_stages > 1; }
// Each pipeline rank builds only its stages' layers (dist.pipeline_model = "stages").
inline bool builds_stage_models(const Config& config) {
  return pipelined(config) && config.dist.pipeline_model == "stages";
}

// The dist.pipeline_* keys against the rest of the config, `world_size` ranks (a multiple of
// the stages) and the training device, before anything is read or allocated: one line naming
// the key. With the pipeline off, only that its other keys are left at their defaults.
void check_pipeline_config(const Config& config, int world_size, Device device);

// The activation frames pipeline rank `rank` (its place in its replica's pipeline) needs
// (Model::enable_activation_frames): with dist.pipeline_activations = "frames", the most
// (micro-batch, stage) pairs it holds in flight -- forward run, weight pass not: ZB-H1's
// split backward holds a pair's frame until its W -- from the schedule's simulation (1 for
// a rank that runs each backward right after its forward); 0 without a pipeline or with
// "recompute".
int pipeline_activation_frames(const Config& config, int rank);

// Micro-batches each of `stages` model stages keeps in flight under the config's schedule
// (PipelineCosts::stage_in_flight): its rank's activation frames, or 1 with "recompute".
// `stages` counts model stages (ranks x dist.pipeline_virtual_stages when interleaved).
std::vector<int> pipeline_stage_in_flight(const Config& config, int64_t stages);

// The ranks' places: dist.pipeline_stages stages x world_size / stages replicas.
pipeline::Layout pipeline_layout(const Config& config, int world_size);

// The data config the training stream reads: the config's, or with the pipeline on, the
// shard of rank `rank`'s replica (data.rank = replica, data.world_size = replicas).
DataConfig pipeline_data_config(const Config& config, int rank, int world_size);

// The stages' first layers, and the schedule for `ranks` pipeline ranks, as the config asks
// (dist.pipeline_split, else planned from the per-layer costs dist.pipeline_costs names, or
// with `measure` false from the estimated ones whatever it names).
std::vector<int64_t> pipeline_bounds(const Config& config, bool measure = true);
pipeline::Schedule pipeline_schedule(const Config& config, int ranks);

// The bounds every rank runs, agreed before any model is built: as pipeline_bounds, but with
// measured costs (which differ from rank to rank, and which ranks measuring at once would
// skew by competing for the cores) rank 0 alone measures, plans and broadcasts them over
// `group` (every rank of the run); `balance` gets rank 0's predicted balance.
std::vector<int64_t> agree_pipeline_bounds(const Config& config, dist::Communicator& group, std::string& balance);
// The layer ranges of pipeline rank `rank`'s stages under the config's schedule
// (BuildOptions::layers of its model with dist.pipeline_model = "stages").
std::vector<std::pair<int64_t, int64_t>> pipeline_rank_layers(const Config& config, const std::vector<int64_t>& bounds,
                                                              int rank);

class PipelineTrainerStep {
 public:
  // `group`: every rank of the run (stages x replicas), whose rank places this one;
  // `bounds`, `balance`: agree_pipeline_bounds'. `model`: the whole model, or with
  // dist.pipeline_model = "stages" this rank's stages' (pipeline_rank_layers).
  PipelineTrainerStep(const Config& config, Model& model, dist::Communicator& group, std::vector<int64_t> bounds,
                      std::string balance);
  // The model holds only this rank's stages (dist.pipeline_model = "stages").
  bool stage_models() const { return !model_.backbone().whole(); }

  // The forward and backward of the step's micro-batches through this rank's stages,
  // gradients accumulated into the model's (each scaled by `gradient_scale`, as
  // Model::forward_backward's); returns this rank's share of the step's loss sums,
  // micro-batch after micro-batch. Summed over the ranks with the gradients (StepProgram).
  LossSlotSums run(const std::vector<HostBatch>& batches, double gradient_scale);

  // Stage models only. Every rank of the replica calls these at once.
  // The main head's loss sums of `batch` through the stages, forward only (validation):
  // on the rank of the last stage; zeros on the others (their sum over the ranks is the batch's).
  LossSums evaluate(const HostBatch& batch);
  // The gradient exchange of the step (DataParallel::use_stage_gradients); `replicas`:
  // this rank's stage's replicas (null with one); `sharded_gradients`: ZeRO-2 leaves each
  // replica its shard's sums, so every rank's squares count toward the norm.
  std::unique_ptr<StageGradients> stage_gradients(dist::Communicator* replicas, bool sharded_gradients);
  // On rank 0: replica 0's other ranks' weights to save beside its own
  // (train/stage_weights.h); nothing elsewhere (the other replicas take no part).
  std::vector<GatheredWeight> gather_weights();
  // The components' metrics of the last step (Model::component_metrics) of every stage on
  // pipeline rank 0 (the log's), this rank's own elsewhere. Replica 0's ranks take part (the
  // other replicas' are the same, summed over the replicas).
  std::vector<std::pair<std::string, double>> component_metrics();
  // Whether this rank writes its state to a checkpoint: replica 0's ranks (the others'
  // optimizer state is the same; under ZeRO every rank writes its shard's: the trainer).
  bool saves_state() const { return layout_.replica_of(group_rank_) == 0; }
  // The model's parameters over every stage (the tied table once); stage models only.
  int64_t whole_parameter_count() const { return whole_parameters_; }

  // "pipeline: 2 stages on 2 ranks (1f1b, 4 micro-batches a step), layers 0..3, 4..7; this rank
  // runs stage 1; every rank keeps the whole model; 2 activation frames (...)", and with
  // D > 1 replicas ", x 2 replicas
  // (stage = rank / 2, replica = rank % 2): this rank is replica 1"; on rank 0 with measured
  // costs, then the split's predicted balance.
  std::string describe() const;

 private:
  Model& model_;
  const pipeline::Layout layout_;
  const int group_rank_;
  std::unique_ptr<dist::Communicator> comm_;  // this rank's replica's pipeline
  std::string measured_balance_;  // rank 0, dist.pipeline_costs = "measure": the split's predicted balance
  const std::vector<int64_t> bounds_;  // first layer of each stage, then model.layers
  const pipeline::Schedule schedule_;
  // zb_h1 with frames and dist.pipeline_split_backward: the stages leave LinearLayers' weight
  // gradients to the W pass (pipeline_model_stage.h).
  const bool split_backward_;
  int64_t whole_parameters_ = 0;  // stage models: summed over the ranks
};

}  // namespace kiln

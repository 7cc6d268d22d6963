#include "train/pipeline_trainer_step.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>


#include "core/error.h"
#include "train/pipeline_costs.h"
#include "train/pipeline_costs_measured.h"
#include "train/pipeline_engine.h"
#include "train/pipeline_model_stage.h"
#include "train/pipeline_simulator.h"
#include "train/pipeline_split.h"

namespace kiln {
namespace {

int model_stages(const Config& config) {
  return static_cast<int>(config.dist.pipeline_stages * config.dist.pipeline_virtual_stages);
}

}  // namespace

void check_pipeline_config(const Config& config, int world_size, Device device) {
  const DistConfig& d = config.dist;
  if (!pipelined(config)) {
    KILN_CHECK(d.pipeline_split.empty(), "dist.pipeline_split",
               "'{}' is given, but dist.pipeline_stages = 1 (the pipeline is off)", d.pipeline_split);
    KILN_CHECK(d.pipeline_virtual_stages == 1, "dist.pipeline_virtual_stages",
               "{} is given, but dist.pipeline_stages = 1 (the pipeline is off)", d.pipeline_virtual_stages);
    KILN_CHECK(d.pipeline_costs == "estimate", "dist.pipeline_costs",
               "'{}' is given, but dist.pipeline_stages = 1 (the pipeline is off)", d.pipeline_costs);
    KILN_CHECK(d.pipeline_activations == "frames", "dist.pipeline_activations",
               "'{}' is given, but dist.pipeline_stages = 1 (the pipeline is off)", d.pipeline_activations);
    KILN_CHECK(d.pipeline_model == "whole", "dist.pipeline_model",
               "'{}' is given, but dist.pipeline_stages = 1 (the pipeline is off)", d.pipeline_model);
    return;
  }
  KILN_CHECK(world_size >= d.pipeline_stages && world_size % d.pipeline_stages == 0, "dist.pipeline_stages",
             "{} stages need a multiple of {} ranks (one per stage in each data-parallel replica), {} run",
             d.pipeline_stages, d.pipeline_stages, world_size);
  // Stage models shard each stage's optimizer state (and gradients) over the stage's
  // replicas; with one replica each rank already holds its stages' alone.
  KILN_CHECK(d.zero == 0 || d.pipeline_model == "whole" || world_size > d.pipeline_stages, "dist.zero",
             "{} with dist.pipeline_model = stages shards each stage over its data-parallel replicas, and {} ranks "
             "for {} stages make one replica: nothing to shard (set 0: each rank already keeps only its stages' "
             "state)",
             d.zero, world_size, d.pipeline_stages);
  KILN_CHECK(device == Device::cpu, "train.device",
             "the pipeline (dist.pipeline_stages = {}) runs on the CPU only for now (Gloo; the engine's buffers are "
             "host memory)",
             d.pipeline_stages);
  KILN_CHECK(d.pipeline_virtual_stages == 1 || d.pipeline_schedule == "interleaved", "dist.pipeline_virtual_stages",
             "{} stages per rank need dist.pipeline_schedule = interleaved, not '{}'", d.pipeline_virtual_stages,
             d.pipeline_schedule);
  // With whole models ZeRO shards the optimizer (and with 2 the gradients) over all W
  // ranks, and the step's gradient sum -- the all-reduce, or ZeRO-2's reduce-scatter -- runs
  // over all of them too, so each shard holds its parameters' summed gradient whichever
  // stage computed it (the others add zeros). With stage models, over each stage's replicas
  // (train/stage_gradients.h).
  // The counting pass runs every micro-batch through the whole model and sums over the
  // ranks: with a replica's ranks reading the same micro-batches it would count them `stages` times.
  KILN_CHECK(config.model.moe.balance_scope != "step", "model.moe.balance_scope",
             "'step' is not pipelined yet (dist.pipeline_stages = {})", d.pipeline_stages);
  pipeline::ModelStage::check_pipelinable(config.model);
  // The split: given and valid, or plannable (any costs of these layers plan one: estimated
  // here, the run measures them once its ranks are up).
  pipeline_bounds(config, false);
  pipeline_schedule(config, static_cast<int>(d.pipeline_stages));  // the micro-batches it needs (train.grad_accum)
}

int pipeline_activation_frames(const Config& config, int rank) {
  if (!pipelined(config) || config.dist.pipeline_activations == "recompute") return 0;
  // Stage `rank` is the rank's first (Schedule::rank_of), and every stage of a rank counts
  // its rank's pairs in flight.
  const std::vector<int> in_flight = pipeline_stage_in_flight(config, model_stages(config));
  KILN_CHECK(rank >= 0 && rank < static_cast<int>(config.dist.pipeline_stages), "pipeline", "pipeline rank {} of {}",
             rank, config.dist.pipeline_stages);
  return in_flight[static_cast<size_t>(rank)];
}

std::vector<int> pipeline_stage_in_flight(const Config& config, int64_t stages) {
  if (config.dist.pipeline_activations == "recompute") return std::vector<int>(static_cast<size_t>(stages), 1);
  const int64_t virtual_stages = config.dist.pipeline_schedule == "interleaved" ? config.dist.pipeline_virtual_stages : 1;
  KILN_CHECK(stages % virtual_stages == 0, "dist.pipeline_virtual_stages",
             "{} stages are not a multiple of {} virtual stages per rank", stages, virtual_stages);
  Config schedule_config = config;
  schedule_config.dist.pipeline_stages = stages / virtual_stages;
  const pipeline::Simulation simulation =
      pipeline::simulate(pipeline_schedule(schedule_config, static_cast<int>(stages / virtual_stages)));
  KILN_CHECK(simulation.ok, "dist.pipeline_schedule", "the schedule does not run: {}", simulation.problem);
  std::vector<int> in_flight;
  for (int64_t s = 0; s < stages; ++s)
    in_flight.push_back(std::max(simulation.peak_in_flight[static_cast<size_t>(s % (stages / virtual_stages))], 1));
  return in_flight;
}

pipeline::Layout pipeline_layout(const Config& config, int world_size) {
  const auto stages = static_cast<int>(config.dist.pipeline_stages);
  return pipeline::Layout{stages, world_size / stages};
}

DataConfig pipeline_data_config(const Config& config, int rank, int world_size) {
  DataConfig data = config.data;
  if (pipelined(config)) {
    const pipeline::Layout layout = pipeline_layout(config, world_size);
    data.world_size = layout.replicas;
    data.rank = layout.replica_of(rank);
  }
  return data;
}

std::vector<int64_t> pipeline_bounds(const Config& config, bool measure) {
  const int stages = model_stages(config);
  PipelineSplit split;
  if (!config.dist.pipeline_split.empty()) {
    split = parse_pipeline_split(config.dist.pipeline_split, "dist.pipeline_split");
    validate_pipeline_split(split, config.model.layers, stages, "dist.pipeline_split");
  } else {
    KILN_CHECK(stages <= config.model.layers, "dist.pipeline_stages",
               "{} stages ({} ranks x {} virtual) for model.layers = {}: a stage needs a layer", stages,
               config.dist.pipeline_stages, config.dist.pipeline_virtual_stages, config.model.layers);
    PipelineCosts costs = measure ? pipeline_costs_for(config, Device::cpu)
                                  : pipeline_costs_from_config(config, Device::cpu);
    costs.stage_in_flight = pipeline_stage_in_flight(config, stages);
    split = plan_pipeline_split(costs, stages, 0, "dist.pipeline_stages");
  }
  split.push_back(config.model.layers);
  return split;
}

pipeline::Schedule pipeline_schedule(const Config& config, int ranks) {
  const std::string& name = config.dist.pipeline_schedule;
  const auto m = static_cast<int>(config.train.grad_accum);
  if (name == "gpipe") return pipeline::build_gpipe(ranks, m);
  if (name == "1f1b") return pipeline::build_1f1b(ranks, m);
  if (name == "interleaved")
    return pipeline::build_interleaved_1f1b(ranks, static_cast<int>(config.dist.pipeline_virtual_stages), m);
  if (name == "zb_h1") return pipeline::build_zero_bubble_h1(ranks, m);
  fail("dist.pipeline_schedule", "unknown schedule '{}' (known: gpipe, 1f1b, interleaved, zb_h1)", name);
}

std::vector<int64_t> agree_pipeline_bounds(const Config& config, dist::Communicator& group, std::string& balance) {
  if (config.dist.pipeline_costs != "measure" || !config.dist.pipeline_split.empty()) return pipeline_bounds(config);
  std::vector<int64_t> bounds(static_cast<size_t>(model_stages(config)) + 1);
  if (group.rank() == 0) {
    PipelineCosts costs = pipeline_costs_measured(config, Device::cpu);
    costs.stage_in_flight = pipeline_stage_in_flight(config, model_stages(config));
    PipelineSplit split = plan_pipeline_split(costs, model_stages(config), 0, "dist.pipeline_stages");
    balance = describe_pipeline_balance(costs, pipeline_balance(costs, split));
    split.push_back(config.model.layers);
    bounds = split;
  }
  group.broadcast(bounds.data(), static_cast<int64_t>(bounds.size() * sizeof(int64_t)), 0, "pipeline bounds");
  return bounds;
}

std::vector<std::pair<int64_t, int64_t>> pipeline_rank_layers(const Config& config, const std::vector<int64_t>& bounds,
                                                              int rank) {
  const pipeline::Schedule schedule = pipeline_schedule(config, static_cast<int>(config.dist.pipeline_stages));
  std::vector<std::pair<int64_t, int64_t>> layers;
  for (int s = 0; s < schedule.stages(); ++s)
    if (schedule.rank_of(s) == rank) layers.emplace_back(bounds[static_cast<size_t>(s)], bounds[static_cast<size_t>(s) + 1]);
  return layers;
}

PipelineTrainerStep::PipelineTrainerStep(const Config& config, Model& model, dist::Communicator& group,
                                         std::vector<int64_t> bounds, std::string balance)
    : model_(model),
      layout_(pipeline_layout(config, group.world_size())),
      group_rank_(group.rank()),
      comm_(pipeline::replica_pipeline(group, layout_)),
      measured_balance_(std::move(balance)),
      bounds_(std::move(bounds)),
      schedule_(pipeline_schedule(config, layout_.stages)),
      split_backward_(config.dist.pipeline_schedule == "zb_h1" && config.dist.pipeline_split_backward &&
                      config.dist.pipeline_activations == "frames") {
  // This rank's stages' layers get a frame per pair it holds in flight at most.
  const int frames = pipeline_activation_frames(config, comm_->rank());
  if (frames > 0) {
    std::vector<std::pair<int64_t, int64_t>> mine;
    for (int s = 0; s < schedule_.stages(); ++s)
      if (schedule_.rank_of(s) == comm_->rank())
        mine.emplace_back(bounds_[static_cast<size_t>(s)], bounds_[static_cast<size_t>(s) + 1]);
    model_.enable_activation_frames(frames, mine);
  }
  if (stage_models()) {  // replica 0's ranks count, each parameter once
    if (saves_state())
      for (const auto& p : model_.parameters())
        if (saves_weight(model_, *p)) whole_parameters_ += p->value().numel();
    group.all_reduce(&whole_parameters_, 1, DType::i64, dist::ReduceOp::sum, "parameter counts");
  }
}

namespace {

// The tag of a stage boundary's activation in validation (evaluate): beyond the step's
// transfers' and the gradient exchanges' (train/stage_gradients.cpp, stage_weights.cpp).
// Between two ranks its messages are received in the order sent: boundary after boundary.
constexpr int kEvaluationTag = (1 << 29) + 8;
// The tags of a rank's component metrics on their way to rank 0 (send_text: this and + 1).
constexpr int kMetricsTag = (1 << 29) + 9;

}  // namespace

LossSums PipelineTrainerStep::evaluate(const HostBatch& batch) {
  KILN_CHECK(stage_models(), "pipeline", "validation through the stages needs a model built per stage");
  const int me = comm_->rank();
  LossSums sums{};
  model_.load_batch(batch);
  for (int s = 0; s < schedule_.stages(); ++s) {
    if (schedule_.rank_of(s) != me) continue;
    const int64_t first = bounds_[static_cast<size_t>(s)], last = bounds_[static_cast<size_t>(s) + 1];
    // A boundary between two stages of this rank is the residual stream's row already there.
    if (s > 0 && schedule_.rank_of(s - 1) != me) {
      const Tensor input = model_.stage_activation(first);
      comm_->recv(input.raw(), static_cast<int64_t>(input.nbytes()), schedule_.rank_of(s - 1), kEvaluationTag,
                  "validation activations");
    }
    const LossSums stage_sums = model_.evaluate_layers(first, last);
    if (last == bounds_.back()) sums = stage_sums;
    if (s + 1 < schedule_.stages() && schedule_.rank_of(s + 1) != me) {
      const Tensor output = model_.stage_activation(last);
      comm_->send(output.raw(), static_cast<int64_t>(output.nbytes()), schedule_.rank_of(s + 1), kEvaluationTag,
                  "validation activations");
    }
  }
  return sums;
}

std::unique_ptr<StageGradients> PipelineTrainerStep::stage_gradients(dist::Communicator* replicas,
                                                                     bool sharded_gradients) {
  return std::make_unique<StageGradients>(model_, *comm_, schedule_.rank_of(0), schedule_.rank_of(schedule_.stages() - 1),
                                          replicas, saves_state() || sharded_gradients);
}

std::vector<std::pair<std::string, double>> PipelineTrainerStep::component_metrics() {
  std::vector<std::pair<std::string, double>> metrics = model_.component_metrics();
  if (!stage_models() || !saves_state()) return metrics;
  if (comm_->rank() != 0) {
    send_text(*comm_, 0, kMetricsTag, nlohmann::json(metrics).dump(), "component metrics");
    return metrics;
  }
  for (int r = 1; r < comm_->world_size(); ++r) {
    // (JSON writes a non-finite value as null: it comes back as NaN.)
    for (const nlohmann::json& pair : nlohmann::json::parse(recv_text(*comm_, r, kMetricsTag, "component metrics")))
      metrics.emplace_back(pair.at(0).get<std::string>(),
                           pair.at(1).is_number() ? pair.at(1).get<double>() : std::nan(""));
  }
  return metrics;
}

std::vector<GatheredWeight> PipelineTrainerStep::gather_weights() {
  return saves_state() ? gather_stage_weights(model_, *comm_) : std::vector<GatheredWeight>{};
}

LossSlotSums PipelineTrainerStep::run(const std::vector<HostBatch>& batches, double gradient_scale) {
  KILN_CHECK(static_cast<int>(batches.size()) == schedule_.microbatches, "train",
             "{} micro-batches for a pipeline schedule of {}", batches.size(), schedule_.microbatches);
  pipeline::ModelStage stage(model_, bounds_, batches, gradient_scale);
  stage.split_backward(split_backward_);
  pipeline::run_pipeline_step(schedule_, stage, *comm_);
  // In micro-batch order, as the one-process step adds them: the main loss (the last
  // stage's) sums bit for bit alike.
  LossSlotSums sums{};
  for (const auto& [microbatch, micro] : stage.losses())
    for (size_t k = 0; k < sums.size(); ++k) sums[k] += micro.slot[k];
  return sums;
}

std::string PipelineTrainerStep::describe() const {
  std::string layers, mine;
  for (size_t s = 0; s + 1 < bounds_.size(); ++s) {
    layers += fmt::format("{}{}..{}", s == 0 ? "" : ", ", bounds_[s], bounds_[s + 1] - 1);
    if (schedule_.rank_of(static_cast<int>(s)) == comm_->rank()) mine += fmt::format("{}{}", mine.empty() ? "" : ", ", s);
  }
  std::string replicas;
  if (layout_.replicas > 1)
    replicas = fmt::format(", x {} data-parallel replicas (stage = rank / {}, replica = rank % {}): this rank is "
                           "replica {}",
                           layout_.replicas, layout_.replicas, layout_.replicas, layout_.replica_of(group_rank_));
  std::string out = fmt::format(
      "pipeline: {} stages on {} ranks ({}, {} micro-batches a step), layers {}; this rank runs stage {}; {}{}; {}",
      schedule_.stages(), schedule_.ranks, schedule_.name, schedule_.microbatches, layers, mine,
      stage_models() ? fmt::format("it builds only its stages' layers: {} of the model's {} parameters",
                                   model_.parameter_count(), whole_parameters_)
                     : std::string("every rank keeps the whole model"),
      replicas,
      model_.has_activation_frames()
          ? fmt::format("{} activation frames of its stages' saved activations, one per micro-batch in flight "
                        "({:.1f} MiB beyond the first)",
                        model_.activation_frames(), static_cast<double>(model_.activation_frame_bytes()) / 1048576.0)
          : std::string("each stage's forward recomputed before its backward"));
  if (split_backward_) out += "; backward split: the projections' weight gradients wait for the W passes";
  if (!measured_balance_.empty()) out += "\nsplit planned from measured costs (dist.pipeline_costs):\n" + measured_balance_;
  return out;
}

}  // namespace kiln

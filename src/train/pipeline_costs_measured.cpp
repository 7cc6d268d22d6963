#include "train/pipeline_costs_measured.h"

#include "core/device_memory.h"
#include "core/error.h"
#include "model/model.h"
#include "nn/mup.h"
#include "train/optimizer_groups.h"
#include "train/pipeline_costs.h"
#include "train/synthetic_batch.h"
#include "train/training_build.h"

#include <algorithm>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>

namespace kiln {

namespace {

constexpr int kRepeats = 3;  // timed runs per measurement, after one warm-up

// Milliseconds of one `run`: the mean of kRepeats after a warm-up (which also leaves the
// buffers the run reads written), the device's queue drained around the clock.
double mean_ms(const Model& model, const std::function<void()>& run) {
  const auto drain = [&] {
    if (model.options().device == Device::cuda) synchronize_stream(model.exec());
  };
  run();
  drain();
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < kRepeats; ++i) run();
  drain();
  const std::chrono::duration<double, std::milli> elapsed = std::chrono::steady_clock::now() - start;
  return elapsed.count() / kRepeats;
}

}  // namespace

PipelineMemory measure_pipeline_memory(const Config& config, const Model& model) {
  const int64_t layers = config.model.layers;
  // The optimizer's state, planned as the trainer plans it (unsharded): exact, the arena
  // allocates what it plans. Each state tensor is named after its parameter
  // ("<parameter>.exp_avg"); what no parameter owns (Muon's Newton-Schulz scratch, one per
  // group) is not a layer's and stays with the rest of the model below.
  Arena state("optimizer", model.options().device);
  const std::unique_ptr<Optimizer> optimizer =
      make_optimizer(model.exec(), config.optim, model.parameters(), mup_width_ratio(config.model));
  optimizer->plan(state);
  std::map<std::string, size_t> by_parameter;
  for (const auto& p : model.parameters()) by_parameter[p->name()] = 0;
  for (const OptimizerStateTensor& t : optimizer->state_tensors()) {
    std::string owner = t.name;
    while (!by_parameter.contains(owner) && owner.rfind('.') != std::string::npos) owner.resize(owner.rfind('.'));
    if (by_parameter.contains(owner)) by_parameter[owner] += Workspace::footprint(t.tensor.dtype(), t.tensor.shape());
  }

  PipelineMemory out;
  double sum = 0;
  for (int64_t l = 0; l < layers; ++l) {
    const Model::BlockMemory block = model.block_memory(l);
    PipelineMemory::Layer layer;
    layer.parameters = block.parameters + block.compute_copies;
    layer.gradients = block.gradients;
    layer.activations = block.activations;
    layer.buffers = block.buffers;
    for (size_t i = block.first_parameter; i < block.last_parameter; ++i)
      layer.optimizer += by_parameter.at(model.parameters()[i]->name());
    sum += static_cast<double>(layer.total());
    out.layers.push_back(layer);
  }
  // The embedding: its table, compute copy (the mixed path's: a tensor of its own), gradient
  // and optimizer state, each one arena entry.
  const Backbone& backbone = model.backbone();
  const Parameter& table = backbone.embedding();
  const auto footprint = [](const Tensor& t) { return t.defined() ? Workspace::footprint(t.dtype(), t.shape()) : 0; };
  const bool copy = backbone.embedding_compute().dtype() != table.value().dtype();
  out.embedding = footprint(table.value()) + (copy ? footprint(backbone.embedding_compute()) : 0) +
                  footprint(backbone.embedding_grad()) + by_parameter.at(table.name());
  // The whole model as the memory check counts it (its workspace aside): the rest is the
  // last stage's (the final norm, the heads, multi-token prediction, the model's own
  // per-micro-batch state, the optimizer's unowned scratch).
  const MemoryPlan plan = model.memory_plan();
  out.whole = plan.parameters + plan.gradients + plan.activations + state.planned_bytes();
  out.rest = static_cast<size_t>(
      std::max(0.0, static_cast<double>(out.whole) - sum - static_cast<double>(out.embedding)));
  return out;
}

PipelineCosts pipeline_costs_measured(const Config& config, Device device) {
  KILN_CHECK(device == Device::cpu || cuda_available(), "dist.pipeline_costs",
             "'measure' times the layers on the training device, a GPU, and none is found here");
  // The layers' kinds and the refusals (Block Attention Residuals) are the estimate's; its
  // times and memory are replaced below.
  PipelineCosts costs = pipeline_costs_from_config(config, device);
  const int64_t layers = config.model.layers;
  Model model(config.model, training_build_options(config, device));
  model.allocate();
  // Memory: what the model just allocated, layer by layer (each layer its own, not its
  // kind's: the model plans each block with its own precision recipe, train.fp8_layers,
  // which the kind does not name). It differs from the estimate's in the optimizer state,
  // which the estimate spreads by parameter count over every parameter while the measure
  // gives each layer its own parameters' state (a router's bias, trained by no optimizer,
  // has none; alignment padding stays with its tensor; Muon's scratch belongs to no layer),
  // where train.fp8_layers gives a block another recipe than the model's (the estimate plans
  // every block with the model's), and for a block under train.recompute_blocks (its input
  // row alone: Model::BlockMemory).
  const PipelineMemory memory = measure_pipeline_memory(config, model);
  for (int64_t l = 0; l < layers; ++l) {
    const PipelineMemory::Layer& layer = memory.layers[static_cast<size_t>(l)];
    costs.layers[static_cast<size_t>(l)].memory = static_cast<double>(layer.total());
    costs.layers[static_cast<size_t>(l)].activations = static_cast<double>(layer.activations);
  }
  const auto table = static_cast<double>(memory.embedding);
  costs.first_extra.memory = table;
  // A tied head reads a copy of the table on the last stage (as the estimate counts it).
  costs.last_extra.memory = static_cast<double>(memory.rest) + (config.model.tie_embeddings ? table : 0.0);
  model.init_weights(config.train.seed);
  const HostBatch batch = synthetic_batch(config);
  model.load_batch(batch);
  const double loss_scale = 1.0 / static_cast<double>(batch.target_count);
  // Every stage pass re-converts the compute copies of the weights and resets the loss sums
  // (Model::forward_layers): a cost of the stage, not of its layers. An empty range inside
  // the model runs only that, and is taken off every range below (with one layer there is no
  // such range, and the layer's time keeps it).
  const auto range = [&](int64_t first, int64_t last) {
    return mean_ms(model, [&] {
      model.forward_layers(first, last, loss_scale, false);
      model.backward_layers(first, last);
    });
  };
  // One pass of the whole model first: every residual, the heads' d(hidden) and the
  // residual stream's gradient written, so any range can run from them.
  model.forward_layers(0, layers, loss_scale, false);
  model.stage_heads(loss_scale);
  model.backward_layers(0, layers);
  const double overhead = layers > 1 ? range(1, 1) : 0.0;
  const double embedding = std::max(0.0, range(0, 0) - overhead);       // the lookup and its gradient
  const double final_norm = std::max(0.0, range(layers, layers) - overhead);
  const double heads = mean_ms(model, [&] { model.stage_heads(loss_scale); });  // LM head, loss (and MTP)
  costs.first_extra.time = embedding;
  costs.last_extra.time = final_norm + heads;

  // One layer of each kind, inside the model where there is one (a range at either end also
  // runs the embedding or the final norm, measured above and taken off).
  std::map<std::string, double> by_kind;
  for (int64_t pass = 0; pass < 2; ++pass)
    for (int64_t l = 0; l < layers; ++l) {
      const std::string& kind = costs.layer_kinds[static_cast<size_t>(l)];
      const bool inside = l > 0 && l + 1 < layers;
      if (by_kind.contains(kind) || (pass == 0 && !inside)) continue;
      const double whole = range(l, l + 1);
      const double measured =
          whole - overhead - (l == 0 ? embedding : 0.0) - (l + 1 == layers ? final_norm : 0.0);
      // Timing noise must not make a layer free (the planner would pile them on one stage).
      by_kind[kind] = std::max(measured, 1e-3 * whole);
    }
  for (int64_t l = 0; l < layers; ++l)
    costs.layers[static_cast<size_t>(l)].time = by_kind.at(costs.layer_kinds[static_cast<size_t>(l)]);
  costs.measured = true;
  costs.measured_on = std::string(device_name(device));
  return costs;
}

PipelineCosts pipeline_costs_for(const Config& config, Device device) {
  const std::string& source = config.dist.pipeline_costs;
  if (source == "measure") return pipeline_costs_measured(config, device);
  KILN_CHECK(source == "estimate", "dist.pipeline_costs", "unknown '{}' (known: estimate, measure)", source);
  return pipeline_costs_from_config(config, device);
}

}  // namespace kiln

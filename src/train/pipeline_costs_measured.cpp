#include "train/pipeline_costs_measured.h"

#include "core/device_memory.h"
#include "core/error.h"
#include "model/model.h"
#include "train/pipeline_costs.h"
#include "train/synthetic_batch.h"
#include "train/training_build.h"

#include <algorithm>
#include <chrono>
#include <functional>
#include <map>

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

PipelineCosts pipeline_costs_measured(const Config& config, Device device) {
  KILN_CHECK(device == Device::cpu || cuda_available(), "dist.pipeline_costs",
             "'measure' times the layers on the training device, a GPU, and none is found here");
  // Memory, the layers' kinds and the refusals (Block Attention Residuals) are the estimate's.
  PipelineCosts costs = pipeline_costs_from_config(config, device);
  const int64_t layers = config.model.layers;
  Model model(config.model, training_build_options(config, device));
  model.allocate();
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

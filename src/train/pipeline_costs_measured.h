// Per-layer costs for the pipeline split (train/pipeline_split.h) measured on the device at
// startup (dist.pipeline_costs = "measure"): the time of each distinct block kind's forward
// and backward, timed on the model itself, instead of the FLOPs the config estimates
// (train/pipeline_costs.h), and each layer's memory read from what that model allocated
// instead of the estimate's.
#pragma once

#include "config/config.h"
#include "core/dtype.h"
#include "train/pipeline_split.h"

#include <cstddef>
#include <vector>

namespace kiln {

class Model;

// Bytes read from a model built for training (Model::block_memory: the offsets of each
// block's entries in the model's arenas, the same on the CPU and a GPU) and from its
// optimizer's plan (make_optimizer over its parameters, unsharded).
struct PipelineMemory {
  struct Layer {
    size_t parameters = 0;   // masters, state without gradients, bf16 compute copies
    size_t gradients = 0;
    size_t optimizer = 0;    // the state of the block's own parameters
    size_t activations = 0;  // one micro-batch's saved state, its residual-stream input row included
    size_t buffers = 0;      // buffers and step buffers the block reserved (one copy, not per micro-batch)
    size_t total() const { return parameters + gradients + optimizer + activations + buffers; }
  };
  std::vector<Layer> layers;
  size_t embedding = 0;  // the table, its compute copy, gradient and optimizer state
  // The whole model as the memory check counts it, its workspace aside (parameters,
  // gradients, activations with buffers, optimizer state), and what of it is neither a
  // layer's nor the embedding's: the final norm, the heads, multi-token prediction, the
  // model's own per-micro-batch state (its batch), the position tables, the optimizer's
  // scratch that no parameter owns.
  size_t whole = 0, rest = 0;
};
PipelineMemory measure_pipeline_memory(const Config& config, const Model& model);

// Builds the model for training on `device` (allocated, initialized from train.seed), loads
// one micro-batch of train.micro_batch_tokens random tokens and times, in milliseconds per
// micro-batch (mean of a few runs after a warm-up; CUDA: synchronized), the forward and
// backward of one layer of each kind (pipeline_costs_from_config's layer_kinds), of the
// embedding (first_extra) and of the final norm, LM head and loss (last_extra). Layers of one
// kind get that kind's time. Memory (every LayerCost's memory and activations, the extras'
// memory): measure_pipeline_memory of that model, each layer its own bytes; the last stage's
// extra is its `rest` (and the embedding again with a tied head). One line naming
// dist.pipeline_costs when the device is a GPU and none is found.
PipelineCosts pipeline_costs_measured(const Config& config, Device device);

// The costs dist.pipeline_costs asks for: estimated (pipeline_costs_from_config) or measured.
PipelineCosts pipeline_costs_for(const Config& config, Device device);

}  // namespace kiln

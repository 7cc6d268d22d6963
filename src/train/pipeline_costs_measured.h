// Per-layer costs for the pipeline split (train/pipeline_split.h) measured on the device at
// startup (dist.pipeline_costs = "measure"): the time of each distinct block kind's forward
// and backward, timed on the model itself, instead of the FLOPs the config estimates
// (train/pipeline_costs.h). Memory is still the estimate's.
#pragma once

#include "config/config.h"
#include "core/dtype.h"
#include "train/pipeline_split.h"

namespace kiln {

// Builds the model for training on `device` (allocated, initialized from train.seed), loads
// one micro-batch of train.micro_batch_tokens random tokens and times, in milliseconds per
// micro-batch (mean of a few runs after a warm-up; CUDA: synchronized), the forward and
// backward of one layer of each kind (pipeline_costs_from_config's layer_kinds), of the
// embedding (first_extra) and of the final norm, LM head and loss (last_extra). Layers of one
// kind get that kind's time. Memory: pipeline_costs_from_config's bytes. One line naming
// dist.pipeline_costs when the device is a GPU and none is found.
PipelineCosts pipeline_costs_measured(const Config& config, Device device);

// The costs dist.pipeline_costs asks for: estimated (pipeline_costs_from_config) or measured.
PipelineCosts pipeline_costs_for(const Config& config, Device device);

}  // namespace kiln

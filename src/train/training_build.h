// The model build of a training run (what train, bench, plan and the memory check all
// build): device precision, token budget, loss chunk, recompute, determinism, z-loss,
// QK-Clip's logit tracking.
#pragma once

#include "config/config.h"
#include "model/model.h"

namespace kiln {

BuildOptions training_build_options(const Config& config, Device device);

}  // namespace kiln

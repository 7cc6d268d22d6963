// The optimizers in the registry (train/optimizer.cpp registers them), one file each.
#pragma once

#include "train/optimizer.h"

#include <memory>

namespace kiln {

// AdamW with decoupled weight decay, as torch.optim.AdamW (train/adamw_optimizer.cpp).
std::unique_ptr<Optimizer> make_adamw_optimizer(const OptimizerGroup& group);

}  // namespace kiln

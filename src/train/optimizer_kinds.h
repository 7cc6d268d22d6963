// The optimizers in the registry (train/optimizer.cpp registers them), one file each.
#pragma once

#include "train/optimizer.h"

#include <memory>

namespace kiln {

// AdamW with decoupled weight decay, as torch.optim.AdamW (train/adamw_optimizer.cpp).
std::unique_ptr<Optimizer> make_adamw_optimizer(const OptimizerGroup& group);

// Muon for 2-D matrices: momentum orthogonalized by Newton-Schulz, scaled to AdamW's
// update RMS (train/muon_optimizer.cpp, docs/optimizers.md).
std::unique_ptr<Optimizer> make_muon_optimizer(const OptimizerGroup& group);

}  // namespace kiln

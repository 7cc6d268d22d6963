// ZeRO's optimizer state at a checkpoint: each rank holds slices of the state tensors
// (OptimizerStateTensor::sliced); the save joins them into whole tensors on rank 0, which
// writes the same optimizer.safetensors a run without ZeRO writes. So a checkpoint loads
// at any world size, with or without ZeRO: each rank reads its slices back out of the
// whole tensors (load_checkpoint_tensors).
#pragma once

#include "dist/communicator.h"
#include "train/optimizer.h"

#include <vector>

namespace kiln {

struct GatheredOptimizerState {
  std::vector<OwnedTensor> storage;          // the whole tensors (host), rank 0 only
  std::vector<OptimizerStateTensor> tensors;  // views of them, in name order, rank 0 only
};

// Every rank calls it with its own state tensors, at the same point (host collectives on
// `comm`). Rank 0 gets every tensor whole, and fails naming the tensor if the ranks'
// slices do not cover one exactly; the other ranks get nothing.
GatheredOptimizerState gather_optimizer_state(dist::Communicator& comm, const std::vector<OptimizerStateTensor>& local);

}  // namespace kiln

// ZeRO's optimizer state joined whole on rank 0: each rank holds slices of the state
// tensors (OptimizerStateTensor::sliced); this joins them into the tensors a run without
// ZeRO keeps. Checkpoints no longer use it -- each rank writes its own slices to a shard
// file (train/optimizer_shard_files.h), so rank 0 never holds the whole state -- but
// DataParallel::gather_optimizer_state still offers it (a tool that wants the whole state).
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

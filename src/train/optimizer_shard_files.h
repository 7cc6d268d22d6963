// ZeRO's optimizer state in a checkpoint (dist.zero = 1): each rank writes the state it
// holds -- its slices of the state tensors (OptimizerStateTensor::sliced) -- to a file of
// its own, optimizer.rank-RRRRR-of-WWWWW.safetensors, so no rank ever holds or sends the
// whole state. Each slice is stored flat (1-D, its elements in the whole tensor's order)
// under the state tensor's name; the metadata key "slices" (JSON) gives, per name, the
// whole tensor's shape and the slice's offset in it (elements).
//
// A reader puts any set of slices back together: each of its own tensors (a slice at any
// offset, or a whole tensor) is copied piece by piece out of whichever files' slices
// overlap it. So a checkpoint written by W ranks loads at W' ranks, with or without ZeRO.
#pragma once

#include "train/optimizer.h"

#include <cstdint>
#include <string>
#include <vector>

namespace kiln {

// "optimizer.rank-00001-of-00004.safetensors".
std::string optimizer_shard_name(int rank, int world_size);

// Writes `local` (this rank's state tensors, sliced or whole) to `path` (fsynced, through a
// temporary file and a rename).
void write_optimizer_shard(const std::string& path, const std::vector<OptimizerStateTensor>& local,
                           const std::string& optimizer, int64_t steps, int rank, int world_size);

// Fills every tensor of `local` (this run's state tensors, sliced or whole) from `paths`,
// the shard files of one checkpoint, rank order. Fails naming the file when one does not
// open or disagrees with the others, and naming the tensor when the files lack part of it.
// `strict`: every tensor of the files must be one of `local` (a run that holds the whole
// state; a ZeRO rank reads only its part).
void read_optimizer_shards(const std::vector<std::string>& paths, const std::vector<OptimizerStateTensor>& local,
                           bool strict);

}  // namespace kiln

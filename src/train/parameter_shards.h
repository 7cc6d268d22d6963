// ZeRO's partition of the trainable parameters among the ranks (dist.zero >= 1): the
// parameters laid end to end in model order make one flat index space, cut into world_size
// contiguous shards of nearly equal size; rank r updates (and keeps optimizer state for)
// only the elements of shard r. A cut inside a tensor falls on a multiple of `align`
// elements from the tensor's start, so a block-quantized moment's blocks (AdamW's int8
// state, ops/optim/adamw_lowmem_math.h) are never split between two ranks. A tensor kept
// whole (one Muon orthogonalizes) is never cut: a cut falling inside it moves to its
// nearer end, so it belongs to one rank (Moonlight's distributed Muon gives each matrix to
// one rank the same way).
#pragma once

#include "nn/parameter.h"

#include <cstdint>
#include <optional>
#include <vector>

namespace kiln {

// The part of one parameter inside one shard: elements [begin, begin + count) of it, which
// sit at `flat` in the flat index space.
struct ParameterPiece {
  const Parameter* parameter = nullptr;
  int64_t begin = 0, count = 0;
  int64_t flat = 0;
};

class ParameterShards {
 public:
  // `trainable`: the parameters in model order (every one must share one dtype);
  // `keep_whole[i]`: trainable[i] is never cut (empty: none is).
  ParameterShards(const std::vector<const Parameter*>& trainable, int world_size, int64_t align,
                  const std::vector<bool>& keep_whole = {});

  int world_size() const { return static_cast<int>(pieces_.size()); }
  int64_t total() const { return bounds_.back(); }  // elements of every trainable parameter
  // Shard r is [bound(r), bound(r + 1)) of the flat space.
  int64_t bound(int r) const { return bounds_[static_cast<size_t>(r)]; }
  int64_t largest() const;  // elements of the largest shard
  // Elements per rank and round of the updated parameters' all-gather, so the rounds'
  // buffer (world_size x chunk) is about dist.bucket_mb (0: one round of the largest shard).
  int64_t gather_chunk(double bucket_mb) const;
  DType dtype() const { return dtype_; }
  const std::vector<ParameterPiece>& pieces(int rank) const { return pieces_[static_cast<size_t>(rank)]; }
  // The part of `p` that `rank` updates, if any.
  std::optional<ParameterPiece> piece(int rank, const Parameter* p) const;

 private:
  std::vector<int64_t> bounds_;                      // world_size + 1 cuts of the flat space
  std::vector<std::vector<ParameterPiece>> pieces_;  // per rank, in flat order
  DType dtype_ = DType::f32;
};

}  // namespace kiln

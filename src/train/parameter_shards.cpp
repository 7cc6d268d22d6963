#include "train/parameter_shards.h"

#include "core/error.h"

#include <algorithm>

namespace kiln {

ParameterShards::ParameterShards(const std::vector<const Parameter*>& trainable, int world_size, int64_t align,
                                 const std::vector<bool>& keep_whole) {
  KILN_CHECK(world_size >= 1 && align >= 1, "dist.zero", "{} ranks, alignment {}", world_size, align);
  KILN_CHECK(keep_whole.empty() || keep_whole.size() == trainable.size(), "dist.zero", "{} whole-tensor flags for {} tensors",
             keep_whole.size(), trainable.size());
  std::vector<int64_t> starts;  // each parameter's first flat index
  int64_t total = 0;
  for (const Parameter* p : trainable) {
    KILN_CHECK(p->value().dtype() == trainable.front()->value().dtype(), "dist.zero",
               "{} is {}, the other parameters {}: ZeRO shards parameters of one dtype", p->name(),
               dtype_name(p->value().dtype()), dtype_name(trainable.front()->value().dtype()));
    starts.push_back(total);
    total += p->shape().numel();
  }
  if (!trainable.empty()) dtype_ = trainable.front()->value().dtype();

  // Equal cuts, each moved back onto the alignment of the tensor it falls in, or to the
  // nearer end of a tensor kept whole.
  bounds_.assign(static_cast<size_t>(world_size) + 1, total);
  bounds_[0] = 0;
  for (int r = 1; r < world_size && total > 0; ++r) {
    const int64_t cut = total * r / world_size;
    const auto i = static_cast<size_t>(std::upper_bound(starts.begin(), starts.end(), cut) - starts.begin() - 1);
    const int64_t start = starts[i], end = start + trainable[i]->shape().numel();  // the tensor holding `cut`
    const int64_t moved = !keep_whole.empty() && keep_whole[i] ? (cut - start <= end - cut ? start : end)
                                                               : start + (cut - start) / align * align;
    bounds_[static_cast<size_t>(r)] = std::max(bounds_[static_cast<size_t>(r) - 1], moved);
  }

  pieces_.resize(static_cast<size_t>(world_size));
  for (size_t i = 0; i < trainable.size(); ++i) {
    const int64_t start = starts[i], end = start + trainable[i]->shape().numel();
    for (int r = 0; r < world_size; ++r) {
      const int64_t lo = std::max(start, bound(r)), hi = std::min(end, bound(r + 1));
      if (lo < hi) pieces_[static_cast<size_t>(r)].push_back({trainable[i], lo - start, hi - lo, lo});
    }
  }
}

int64_t ParameterShards::largest() const {
  int64_t most = 0;
  for (int r = 0; r < world_size(); ++r) most = std::max(most, bound(r + 1) - bound(r));
  return most;
}

int64_t ParameterShards::gather_chunk(double bucket_mb) const {
  const int64_t most = std::max<int64_t>(1, largest());
  if (bucket_mb <= 0) return most;
  const double elements = bucket_mb * 1048576.0 / static_cast<double>(dtype_size(dtype_) * world_size());
  return std::clamp<int64_t>(static_cast<int64_t>(elements), 1, most);
}

std::optional<ParameterPiece> ParameterShards::piece(int rank, const Parameter* p) const {
  for (const ParameterPiece& piece : pieces(rank))
    if (piece.parameter == p) return piece;
  return std::nullopt;
}

}  // namespace kiln

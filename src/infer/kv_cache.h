// The key/value cache of incremental decoding: for every layer, K and V of shape
// [slots, max_len, kv_heads, head_dim], planned once in an arena and never reallocated
// (static shapes, so a CUDA decode step can be captured as a graph). A slot holds one
// sequence; which slots are in use, and how long each is, the generator tracks.
#pragma once

#include "core/arena.h"

#include <vector>

namespace kiln {

struct KvCacheShape {
  int64_t layers = 0, slots = 0, max_len = 0, kv_heads = 0, head_dim = 0;
};

class KvCache {
 public:
  // Reserves the tensors in `arena` (allocated by its owner).
  KvCache(Arena& arena, const KvCacheShape& shape, DType dtype);
  KvCache(const KvCache&) = delete;
  KvCache& operator=(const KvCache&) = delete;

  const KvCacheShape& shape() const { return shape_; }
  const Tensor& k(int64_t layer) const { return k_[static_cast<size_t>(layer)]; }
  const Tensor& v(int64_t layer) const { return v_[static_cast<size_t>(layer)]; }
  size_t bytes() const;

 private:
  KvCacheShape shape_;
  DType dtype_;
  std::vector<Tensor> k_, v_;  // per layer; Tensor objects stay put (reserved by address)
};

}  // namespace kiln

#include "infer/kv_cache.h"

#include "core/error.h"

namespace kiln {

KvCache::KvCache(Arena& arena, const KvCacheShape& shape, DType dtype) : shape_(shape), dtype_(dtype) {
  KILN_CHECK(shape.layers > 0 && shape.slots > 0 && shape.max_len > 0 && shape.kv_heads > 0 && shape.head_dim > 0,
             "kv_cache", "every dimension must be positive (layers {}, slots {}, max_len {}, kv_heads {}, head_dim {})",
             shape.layers, shape.slots, shape.max_len, shape.kv_heads, shape.head_dim);
  // Sized before any reserve(): the arena keeps pointers to these Tensor objects.
  k_.resize(static_cast<size_t>(shape.layers));
  v_.resize(static_cast<size_t>(shape.layers));
  const Shape s{shape.slots, shape.max_len, shape.kv_heads, shape.head_dim};
  for (int64_t l = 0; l < shape.layers; ++l) {
    arena.reserve(k_[static_cast<size_t>(l)], dtype, s);
    arena.reserve(v_[static_cast<size_t>(l)], dtype, s);
  }
}

size_t KvCache::bytes() const {
  return 2 * static_cast<size_t>(shape_.layers * shape_.slots * shape_.max_len * shape_.kv_heads * shape_.head_dim) *
         dtype_size(dtype_);
}

}  // namespace kiln

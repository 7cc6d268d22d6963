// Small open-addressing hash tables for the BPE hot paths (vocabulary lookup, merge
// ranks, per-thread word caches, pretoken counting). std::unordered_map allocates per
// node and hashes strings slowly; these keep keys in one arena and probe linearly.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

namespace kiln::bpe {

// A fast non-cryptographic hash of a short byte string (8 bytes per step).
inline uint64_t hash_bytes(std::string_view s) {
  constexpr uint64_t kMul = 0x9E3779B97F4A7C15ull;
  uint64_t h = 0x2545F4914F6CDD1Dull ^ (s.size() * kMul);
  const char* p = s.data();
  size_t n = s.size();
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    h = (h ^ v) * kMul;
    h ^= h >> 29;
    p += 8;
    n -= 8;
  }
  if (n > 0) {
    uint64_t v = 0;
    std::memcpy(&v, p, n);
    h = (h ^ v) * kMul;
  }
  h ^= h >> 32;
  h *= 0xD6E8FEB86659FD93ull;
  return h ^ (h >> 32);
}

inline uint64_t hash_u64(uint64_t x) {
  x ^= x >> 33;
  x *= 0xFF51AFD7ED558CCDull;
  x ^= x >> 33;
  x *= 0xC4CEB9FE1A85EC53ull;
  return x ^ (x >> 33);
}

inline uint64_t pair_key(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

// Byte string -> int64 value. Keys are copied into an internal arena, so a key view
// passed to find_or_insert may die afterwards. Iteration is in insertion order.
class StringMap {
 public:
  explicit StringMap(size_t expected = 16) { rehash(capacity_for(expected)); }

  size_t size() const { return keys_.size(); }
  std::string_view key(size_t index) const {
    return std::string_view(arena_).substr(keys_[index].offset, keys_[index].length);
  }
  int64_t& value(size_t index) { return values_[index]; }
  int64_t value(size_t index) const { return values_[index]; }

  // Index of the key, or -1.
  int64_t find(std::string_view k) const { return find(k, hash_bytes(k)); }
  int64_t find(std::string_view k, uint64_t h) const {
    for (size_t i = h & mask_;; i = (i + 1) & mask_) {
      const int32_t slot = slots_[i];
      if (slot < 0) return -1;
      if (hashes_[static_cast<size_t>(slot)] == h && key(static_cast<size_t>(slot)) == k) return slot;
    }
  }
  // Index of the key, inserting it with `initial` when absent.
  size_t find_or_insert(std::string_view k, int64_t initial = 0) { return find_or_insert(k, hash_bytes(k), initial); }
  size_t find_or_insert(std::string_view k, uint64_t h, int64_t initial) {
    size_t i = h & mask_;
    for (;; i = (i + 1) & mask_) {
      const int32_t slot = slots_[i];
      if (slot < 0) break;
      if (hashes_[static_cast<size_t>(slot)] == h && key(static_cast<size_t>(slot)) == k) return static_cast<size_t>(slot);
    }
    const size_t index = keys_.size();
    keys_.push_back({arena_.size(), static_cast<uint32_t>(k.size())});
    arena_.append(k);
    hashes_.push_back(h);
    values_.push_back(initial);
    slots_[i] = static_cast<int32_t>(index);
    if (keys_.size() * 2 > slots_.size()) rehash(slots_.size() * 2);
    return index;
  }
  uint64_t hash_of(size_t index) const { return hashes_[index]; }
  size_t arena_bytes() const { return arena_.size(); }
  void clear() {
    keys_.clear();
    arena_.clear();
    hashes_.clear();
    values_.clear();
    std::fill(slots_.begin(), slots_.end(), -1);
  }

 private:
  struct Key {
    size_t offset;
    uint32_t length;
  };
  static size_t capacity_for(size_t n) {
    size_t c = 16;
    while (c < n * 2) c *= 2;
    return c;
  }
  void rehash(size_t capacity) {
    slots_.assign(capacity, -1);
    mask_ = capacity - 1;
    for (size_t k = 0; k < hashes_.size(); ++k) {
      size_t i = hashes_[k] & mask_;
      while (slots_[i] >= 0) i = (i + 1) & mask_;
      slots_[i] = static_cast<int32_t>(k);
    }
  }
  std::vector<int32_t> slots_;
  size_t mask_ = 0;
  std::vector<Key> keys_;
  std::string arena_;
  std::vector<uint64_t> hashes_;
  std::vector<int64_t> values_;
};

// uint64 key -> V, for token-id pairs. Key ~0 is reserved as "empty".
template <typename V>
class PairMap {
 public:
  static constexpr uint64_t kEmpty = ~0ull;
  explicit PairMap(size_t expected = 16) {
    size_t c = 16;
    while (c < expected * 2) c *= 2;
    keys_.assign(c, kEmpty);
    values_.resize(c);
    mask_ = c - 1;
  }
  size_t size() const { return size_; }
  const V* find(uint64_t key) const {
    for (size_t i = hash_u64(key) & mask_;; i = (i + 1) & mask_) {
      if (keys_[i] == key) return &values_[i];
      if (keys_[i] == kEmpty) return nullptr;
    }
  }
  V* find(uint64_t key) { return const_cast<V*>(static_cast<const PairMap*>(this)->find(key)); }
  // Reference to the value, default-constructed on first use.
  V& operator[](uint64_t key) {
    size_t i = hash_u64(key) & mask_;
    for (;; i = (i + 1) & mask_) {
      if (keys_[i] == key) return values_[i];
      if (keys_[i] == kEmpty) break;
    }
    if ((size_ + 1) * 2 > keys_.size()) {
      grow();
      return (*this)[key];
    }
    keys_[i] = key;
    ++size_;
    return values_[i];
  }

 private:
  void grow() {
    std::vector<uint64_t> old_keys(keys_.size() * 2, kEmpty);
    std::vector<V> old_values(keys_.size() * 2);
    old_keys.swap(keys_);
    old_values.swap(values_);
    mask_ = keys_.size() - 1;
    for (size_t j = 0; j < old_keys.size(); ++j) {
      if (old_keys[j] == kEmpty) continue;
      size_t i = hash_u64(old_keys[j]) & mask_;
      while (keys_[i] != kEmpty) i = (i + 1) & mask_;
      keys_[i] = old_keys[j];
      values_[i] = std::move(old_values[j]);
    }
  }
  std::vector<uint64_t> keys_;
  std::vector<V> values_;
  size_t mask_ = 0;
  size_t size_ = 0;
};

}  // namespace kiln::bpe

// Dropout's keep-or-drop decision: a pure function of (stream key, site, element index), so
// the CPU reference and the CUDA kernel drop the same elements, the backward and a
// recomputed forward find the forward's mask without storing it, and a resumed run draws
// the masks it would have drawn. A counter-based hash (splitmix64's finalizer, twice)
// rather than a stateful generator: no state to save, capture or advance.
//
//   key   which micro-batch of which step (stream_key below): changes every micro-batch
//   site  which dropout in the model (the embedding, each block's two branches)
//   index the element's flat index in the [tokens, hidden] tensor it drops from
//
// The attention probabilities (model.attention_dropout) index an element by two numbers,
// its row (query token x q_heads + head) and its column (the key's token), both packed
// indices of the micro-batch, so (row, column) is unique within it: the row and the site
// are hashed once per row (attention_row_key), the column into that (attention_keeps).
#pragma once

#include "core/host_device.h"

#include <cstdint>

namespace kiln::dropout {

// 24 bits of the hash decide: an element is dropped when they fall below the threshold.
inline constexpr int kDecisionBits = 24;

KILN_HOST_DEVICE inline uint64_t mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

KILN_HOST_DEVICE inline bool keeps(uint64_t key, uint32_t site, uint64_t index, uint32_t threshold) {
  const uint64_t h = mix64(key ^ mix64((static_cast<uint64_t>(site) << 40) ^ index));
  return static_cast<uint32_t>(h >> (64 - kDecisionBits)) >= threshold;
}

// The sites of the attention probabilities: layer l's is kAttentionSites + l, apart from
// the residual sites (0, 1 + 2l, 2 + 2l) for any model below 2^22 layers. keeps() hashes
// the site's low 24 bits (shifted past a 40-bit index), so this is the top one of them.
inline constexpr uint32_t kAttentionSites = 1u << 23;
inline constexpr uint32_t attention_site(int64_t layer) { return kAttentionSites + static_cast<uint32_t>(layer); }

// The hash of one row of attention probabilities: row = query token * q_heads + head.
KILN_HOST_DEVICE inline uint64_t attention_row_key(uint64_t key, uint32_t site, uint64_t row) {
  return mix64(key ^ mix64((static_cast<uint64_t>(site) << 40) ^ row));
}

// Whether the probability of key token `column` in that row is kept.
KILN_HOST_DEVICE inline bool attention_keeps(uint64_t row_key, uint64_t column, uint32_t threshold) {
  return static_cast<uint32_t>(mix64(row_key ^ column) >> (64 - kDecisionBits)) >= threshold;
}

// The 64-bit key from its device words (i32 [2], low word first).
KILN_HOST_DEVICE inline uint64_t key_of_words(const int32_t* words) {
  return static_cast<uint32_t>(words[0]) | static_cast<uint64_t>(static_cast<uint32_t>(words[1])) << 32;
}

// The key of one micro-batch of a training run: the run's seed, the step, the micro-batch
// within it and the data-parallel rank, so every micro-batch of every rank draws its own
// masks and a resumed run draws the masks of the steps it resumes.
inline uint64_t stream_key(uint64_t seed, int64_t step, int64_t micro_batch, int64_t rank) {
  uint64_t key = mix64(seed ^ 0x64726f706f7574ull);  // "dropout": apart from the seed's other uses
  key = mix64(key ^ static_cast<uint64_t>(step));
  key = mix64(key ^ static_cast<uint64_t>(micro_batch));
  return mix64(key ^ static_cast<uint64_t>(rank));
}

// The threshold of drop probability p in [0, 1): p x 2^24, rounded.
inline uint32_t threshold_of(double p) {
  return static_cast<uint32_t>(p * static_cast<double>(1u << kDecisionBits) + 0.5);
}

}  // namespace kiln::dropout

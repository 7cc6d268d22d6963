// The byte-level BPE model: merges applied inside one pretoken.
//
// Semantics are those of Hugging Face `tokenizers` (models/bpe): a pretoken starts as one
// symbol per byte; the adjacent pair with the lowest merge rank is merged (the leftmost
// one on ties) until no pair has a rank. With ignore_merges, a pretoken that is itself in
// the vocabulary becomes that one token. Bytes missing from the vocabulary become
// <0xNN> tokens (byte_fallback), the unknown token (fused when fuse_unk), or nothing.
//
// Speed: words up to 64 bytes use a scan over a stack array (fastest for short words);
// longer ones a heap over a linked list (n log n). Each thread keeps a cache of encoded
// words of up to 255 bytes (thread_local, tagged by model, cleared when large), so the
// model is safe to share between threads without locks.
#pragma once

#include "data/bpe/flat_hash.h"

#include <cstdint>
#include <string_view>
#include <vector>

namespace kiln::bpe {

struct BpeModelOptions {
  bool ignore_merges = false;
  int32_t unk_id = -1;
  bool fuse_unk = false;
  bool byte_fallback = false;
};

class BpeModel {
 public:
  struct Merge {
    int32_t left = 0, right = 0, merged = 0;
  };
  // vocab: raw token bytes -> id (value). merges: in rank order; a pair listed twice keeps
  // its last rank, as in `tokenizers`.
  BpeModel(StringMap vocab, const std::vector<Merge>& merges, BpeModelOptions options);

  // Appends the ids of one pretoken (thread-safe, cached).
  void encode_word(std::string_view word, std::vector<int32_t>& out) const;
  void encode_word_uncached(std::string_view word, std::vector<int32_t>& out) const;
  // The id of a token's raw bytes, or -1.
  int32_t find(std::string_view bytes) const {
    const int64_t i = vocab_.find(bytes);
    return i < 0 ? -1 : static_cast<int32_t>(vocab_.value(static_cast<size_t>(i)));
  }
  size_t num_merges() const { return merges_.size(); }

 private:
  struct Rank {
    int32_t rank = 0;
    int32_t merged = 0;
  };
  const Rank* rank_of(int32_t a, int32_t b) const { return merges_.find(pair_key(a, b)); }
  // Initial symbols of a word (one per byte, before merges); returns how many.
  void initial_symbols(std::string_view word, std::vector<int32_t>& symbols) const;
  void merge_short(std::vector<int32_t>& symbols) const;
  void merge_long(std::vector<int32_t>& symbols) const;

  StringMap vocab_;
  PairMap<Rank> merges_;
  int32_t byte_ids_[256];
  int32_t fallback_ids_[256];
  BpeModelOptions options_;
  uint64_t serial_;
};

}  // namespace kiln::bpe

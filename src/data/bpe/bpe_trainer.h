// Training a byte-level BPE vocabulary (`kiln train-tokenizer`).
//
// 1. Counting: the text is cut into chunks at line starts (a newline followed by a
//    printable ASCII byte: no standard pattern's pretoken spans such a point, so chunking
//    does not change the counts), chunks are pretokenized in parallel (OpenMP) with the
//    special tokens split out first, and pretokens are counted in per-thread hash maps.
// 2. Merging: the standard incremental algorithm (as in Hugging Face's BpeTrainer): pair
//    counts over all distinct words weighted by their counts, a pair -> words index, and
//    a max-heap of (count, pair) with lazy invalidation. Each merge rewrites only the words
//    that contain the pair and updates the counts of the pairs around each occurrence.
//
// Tie-breaking (deterministic, independent of thread count and input order): the pair
// with the highest count wins; among equal counts, the pair with the smaller left id, then
// the smaller right id. Ids: special tokens first (0..k-1, in the order given), then the
// 256 bytes in byte order, then merged tokens in the order they were created. A merge
// whose result spells an existing token reuses its id (HF does the same); a merge whose
// result would spell a special token is skipped.
#pragma once

#include "data/bpe/flat_hash.h"

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace kiln::bpe {

struct BpeTrainerOptions {
  int64_t vocab_size = 32000;                              // total, special tokens included
  std::vector<std::string> special_tokens{"<|endoftext|>"};
  std::string pattern;                                     // split regex; empty = qwen2
  int64_t min_frequency = 2;                               // a pair seen fewer times is never merged
  bool nfc = false;                                        // NFC-normalize (and write the normalizer)
};

struct TrainedBpe {
  std::vector<std::string> tokens;                  // id -> raw bytes (special tokens: content)
  size_t num_special = 0;                           // ids [0, num_special) are special tokens
  std::vector<std::pair<int32_t, int32_t>> merges;  // in rank order
  std::string pattern;
  bool nfc = false;
};

class BpeTrainer {
 public:
  explicit BpeTrainer(BpeTrainerOptions options);
  // Counts the pretokens of `text` (call it for each input; counts add up).
  void add_text(std::string_view text);
  // Same for a file, read in blocks (64 MiB) cut at chunk boundaries, so a corpus larger
  // than memory trains; the counts equal add_text's on the whole file. Returns the bytes.
  size_t add_file(const std::string& path, size_t block_bytes = size_t{64} << 20);
  int64_t unique_words() const { return static_cast<int64_t>(counts_.size()); }
  int64_t total_words() const { return total_words_; }
  // Runs the merges on the counts so far.
  TrainedBpe train() const;

 private:
  BpeTrainerOptions options_;
  StringMap counts_{1 << 16};  // distinct pretoken bytes -> count
  int64_t total_words_ = 0;
};

// Writes tokenizer.json and tokenizer_config.json (PreTrainedTokenizerFast) into `dir`.
// bos/eos/pad name special tokens; model_max_length goes to tokenizer_config.json.
void write_tokenizer_files(const TrainedBpe& bpe, const std::string& dir, const std::string& bos,
                           const std::string& eos, const std::string& pad, int64_t model_max_length);

}  // namespace kiln::bpe

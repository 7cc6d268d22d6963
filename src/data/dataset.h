// TokenDataset: a corpus read, split into train/validation and tokenized once.
//
// The split is by a hash of each document's text, not by position or random draw: it
// is the same on every run and machine, independent of file order and seed, and exact
// duplicates always land on the same side (no train/validation leakage). Pre-tokenized
// data splits the same way by a hash of each document's tokens, unless it comes split
// (kiln shards: `kiln tokenize` split it by text hash) or data.val_path names the
// validation data.
//
// A TokenizedSplit is a list of documents pointing into token storage: vectors owned by
// the split (text read and tokenized in memory) or memory-mapped shard files, in uint16
// or int32 (TokenSpan). BatchStream reads only this view, so every source packs alike.
#pragma once

#include "data/bad_input.h"
#include "data/document_reader.h"
#include "data/token_span.h"
#include "data/tokenizer.h"
#include "config/config.h"

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kiln {

enum class Split { train, validation };
std::string_view split_name(Split split);

// 64-bit FNV-1a: tiny, stable across platforms and versions (unlike std::hash).
uint64_t fnv1a64(std::string_view bytes, uint64_t hash = 0xcbf29ce484222325ull);
// True when a document with this text belongs to the validation split:
// fnv1a64(text) % 1'000'000 < round(val_fraction * 1'000'000).
bool is_validation_document(std::string_view text, double val_fraction);
// The same rule on any 64-bit document hash (pre-tokenized documents: XXH64 of their
// stored token bytes).
bool is_validation_hash(uint64_t hash, double val_fraction);

// One source of a mixture split (data.sources): documents [first, first + count).
struct SplitSource {
  std::string name;
  double weight = 1.0;
  int64_t first = 0;
  int64_t count = 0;
};

// The tokenized documents of one split, in file order.
class TokenizedSplit {
 public:
  int64_t num_documents() const { return static_cast<int64_t>(docs_.size()); }
  // Content tokens of all documents (BOS/EOS not counted).
  int64_t num_tokens() const { return num_tokens_; }
  TokenSpan document(int64_t i) const {
    const DocRef& d = docs_[static_cast<size_t>(i)];
    return segments_[d.segment].subspan(d.begin, d.length);
  }
  // The document's id in its source (Document::id; for token files, its index among
  // the documents of all files), for messages.
  uint64_t document_id(int64_t i) const { return docs_[static_cast<size_t>(i)].id; }
  // A hash of the documents: a saved stream position is only valid for the same data.
  uint64_t fingerprint() const { return fingerprint_; }

  // Builds from per-document token lists (ids[i] names tokens[i]); owns the tokens.
  static TokenizedSplit build(const std::vector<uint64_t>& ids, const std::vector<std::vector<int32_t>>& tokens);

  // Building over external storage (token files): a segment is a span of tokens that
  // `owner` keeps valid; documents are [begin, end) token ranges of a segment.
  uint32_t add_segment(TokenSpan tokens, std::shared_ptr<const void> owner);
  void add_document(uint32_t segment, uint64_t begin, uint64_t end, uint64_t id);
  void reserve_documents(size_t n) { docs_.reserve(n); }
  // XXH64 of (segment, begin, length, id) of every document, mixed into `seed`.
  uint64_t layout_hash(uint64_t seed) const;
  void set_fingerprint(uint64_t fingerprint) { fingerprint_ = fingerprint; }

  // A mixture's sources, each a contiguous range of documents (empty: one source).
  // BatchStream draws from them by weight (data/mixture.h).
  const std::vector<SplitSource>& sources() const { return sources_; }
  // A split of a mixture: the parts' documents, part after part, with `names` and
  // `weights` per part (validation_batches packs each part apart, data/batch_stream.h). Its fingerprint covers the parts' and the weights.
  static TokenizedSplit concatenate(const std::vector<TokenizedSplit>& parts, const std::vector<std::string>& names,
                                    const std::vector<double>& weights);

 private:
  struct DocRef {
    uint64_t begin;
    uint32_t length;
    uint32_t segment;
    uint64_t id;
  };
  std::vector<TokenSpan> segments_;
  std::vector<std::shared_ptr<const void>> owners_;
  std::vector<DocRef> docs_;
  std::vector<SplitSource> sources_;
  int64_t num_tokens_ = 0;
  uint64_t fingerprint_ = 0;
};

class TokenDataset {
 public:
  // Reads data.path, or each of data.sources alike (each split by its own hash rule; each
  // split the sources' concatenation with SplitSource ranges; data/mixture.cpp). Reads data.path (text/JSONL: read, split by val_fraction and tokenized once, in
  // parallel; shards/llmc/raw: memory-mapped and validated) and data.val_path when set.
  // Bad input follows data.lenient (data/bad_input.h). Throws kiln::Error when there are
  // no documents, or when a split is empty (train always; validation when
  // val_fraction > 0 and the validation data comes from a hash split).
  TokenDataset(const DataConfig& config, const Tokenizer& tokenizer);
  // Same from documents already in memory (tests, other sources); `origin` names them
  // in messages.
  TokenDataset(std::vector<Document> documents, double val_fraction, const Tokenizer& tokenizer,
               const std::string& origin = "documents");

  const TokenizedSplit& split(Split s) const { return s == Split::train ? train_ : validation_; }
  int64_t num_documents(Split s) const { return split(s).num_documents(); }
  int64_t num_tokens(Split s) const { return split(s).num_tokens(); }

  // Bad input skipped while reading (lenient mode; all zero in strict mode), and the
  // summary with the first location per reason ("none" when nothing was skipped).
  const BadInputCounts& skipped() const { return skipped_; }
  const std::string& skipped_summary() const { return skipped_summary_; }

 private:
  TokenDataset() = default;
  // data.sources: each source read as data.path is, then joined (data/mixture.cpp).
  static TokenDataset read_mixture(const DataConfig& config, const Tokenizer& tokenizer);

  TokenizedSplit train_;
  TokenizedSplit validation_;
  BadInputCounts skipped_;
  std::string skipped_summary_ = "none";
};

// Tokenizes `documents` in parallel (OpenMP), in order; encode() must be thread-safe.
std::vector<std::vector<int32_t>> tokenize_documents(const std::vector<Document>& documents, const Tokenizer& tokenizer);

}  // namespace kiln

// TokenDataset: a corpus read, split into train/validation and tokenized once.
//
// The split is by a hash of each document's text, not by position or random draw: it
// is the same on every run and machine, independent of file order and seed, and exact
// duplicates always land on the same side (no train/validation leakage).
//
// Tokens are stored flat per split (one array plus offsets), which is the layout a
// sharded pre-tokenized dataset (a later issue) maps from disk; BatchStream reads only
// this TokenizedSplit view, so such a dataset plugs in without touching the packer.
#pragma once

#include "data/document_reader.h"
#include "data/tokenizer.h"
#include "train/config.h"

#include <cstdint>
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

// The tokenized documents of one split, in file order.
class TokenizedSplit {
 public:
  int64_t num_documents() const { return static_cast<int64_t>(ids_.size()); }
  // Content tokens of all documents (BOS/EOS not counted).
  int64_t num_tokens() const { return static_cast<int64_t>(tokens_.size()); }
  std::span<const int32_t> document(int64_t i) const {
    const auto b = static_cast<size_t>(offsets_[static_cast<size_t>(i)]);
    const auto e = static_cast<size_t>(offsets_[static_cast<size_t>(i) + 1]);
    return std::span<const int32_t>(tokens_).subspan(b, e - b);
  }
  // The document's id in its file (Document::id), for messages.
  uint64_t document_id(int64_t i) const { return ids_[static_cast<size_t>(i)]; }
  // A hash of ids and tokens: a saved stream position is only valid for the same data.
  uint64_t fingerprint() const { return fingerprint_; }

  // Builds from per-document token lists (ids[i] names tokens[i]).
  static TokenizedSplit build(const std::vector<uint64_t>& ids, const std::vector<std::vector<int32_t>>& tokens);

 private:
  std::vector<int32_t> tokens_;
  std::vector<int64_t> offsets_{0};
  std::vector<uint64_t> ids_;
  uint64_t fingerprint_ = 0;
};

class TokenDataset {
 public:
  // Reads config.path (format, separator, text_key), splits by val_fraction and
  // tokenizes every document once, in parallel (OpenMP). Throws kiln::Error when the
  // file has no documents, or when a split is empty (train always; validation when
  // val_fraction > 0) since training or evaluating on nothing is a config mistake.
  TokenDataset(const DataConfig& config, const Tokenizer& tokenizer);
  // Same from documents already in memory (tests, other sources); `origin` names them
  // in messages.
  TokenDataset(std::vector<Document> documents, double val_fraction, const Tokenizer& tokenizer,
               const std::string& origin = "documents");

  const TokenizedSplit& split(Split s) const { return s == Split::train ? train_ : validation_; }
  int64_t num_documents(Split s) const { return split(s).num_documents(); }
  int64_t num_tokens(Split s) const { return split(s).num_tokens(); }

 private:
  TokenizedSplit train_;
  TokenizedSplit validation_;
};

}  // namespace kiln

#include "data/dataset.h"

#include "core/error.h"

#include <cmath>
#include <cstring>

namespace kiln {

std::string_view split_name(Split split) { return split == Split::train ? "train" : "validation"; }

uint64_t fnv1a64(std::string_view bytes, uint64_t hash) {
  for (const char c : bytes) {
    hash ^= static_cast<unsigned char>(c);
    hash *= 0x100000001b3ull;
  }
  return hash;
}

bool is_validation_document(std::string_view text, double val_fraction) {
  const auto threshold = static_cast<uint64_t>(std::llround(val_fraction * 1'000'000.0));
  return fnv1a64(text) % 1'000'000 < threshold;
}

namespace {

uint64_t fnv1a64_value(uint64_t value, uint64_t hash) {
  char bytes[sizeof(value)];
  std::memcpy(bytes, &value, sizeof(value));
  return fnv1a64(std::string_view(bytes, sizeof(bytes)), hash);
}

}  // namespace

TokenizedSplit TokenizedSplit::build(const std::vector<uint64_t>& ids, const std::vector<std::vector<int32_t>>& tokens) {
  KILN_CHECK(ids.size() == tokens.size(), "data", "{} ids for {} token lists", ids.size(), tokens.size());
  TokenizedSplit s;
  size_t total = 0;
  for (const auto& t : tokens) total += t.size();
  s.tokens_.reserve(total);
  s.offsets_.reserve(tokens.size() + 1);
  s.ids_ = ids;
  uint64_t hash = fnv1a64_value(ids.size(), 0xcbf29ce484222325ull);
  for (size_t i = 0; i < tokens.size(); ++i) {
    s.tokens_.insert(s.tokens_.end(), tokens[i].begin(), tokens[i].end());
    s.offsets_.push_back(static_cast<int64_t>(s.tokens_.size()));
    hash = fnv1a64_value(ids[i], hash);
    hash = fnv1a64_value(tokens[i].size(), hash);
    hash = fnv1a64(std::string_view(reinterpret_cast<const char*>(tokens[i].data()), tokens[i].size() * sizeof(int32_t)),
                   hash);
  }
  s.fingerprint_ = hash;
  return s;
}

TokenDataset::TokenDataset(const DataConfig& config, const Tokenizer& tokenizer)
    : TokenDataset(read_documents(config), config.val_fraction, tokenizer, "'" + config.path + "'") {}

TokenDataset::TokenDataset(std::vector<Document> documents, double val_fraction, const Tokenizer& tokenizer,
                           const std::string& origin) {
  KILN_CHECK(val_fraction >= 0.0 && val_fraction < 1.0, "data.val_fraction", "must be in [0, 1), got {}", val_fraction);
  const auto n = static_cast<int64_t>(documents.size());
  KILN_CHECK(n > 0, "data", "{} contains no documents", origin);

  // Tokenize once, in parallel: documents are independent and encode() is const.
  std::vector<std::vector<int32_t>> tokens(static_cast<size_t>(n));
  std::vector<char> is_val(static_cast<size_t>(n));
#pragma omp parallel for schedule(dynamic, 64)
  for (int64_t i = 0; i < n; ++i) {
    const auto& doc = documents[static_cast<size_t>(i)];
    tokens[static_cast<size_t>(i)] = tokenizer.encode(doc.text);
    is_val[static_cast<size_t>(i)] = is_validation_document(doc.text, val_fraction);
  }

  std::vector<uint64_t> ids[2];
  std::vector<std::vector<int32_t>> split_tokens[2];
  for (int64_t i = 0; i < n; ++i) {
    const int side = is_val[static_cast<size_t>(i)] ? 1 : 0;
    ids[side].push_back(documents[static_cast<size_t>(i)].id);
    split_tokens[side].push_back(std::move(tokens[static_cast<size_t>(i)]));
  }
  KILN_CHECK(!ids[0].empty(), "data", "{}: all {} documents fell into validation (data.val_fraction = {}); "
             "lower data.val_fraction or add documents", origin, n, val_fraction);
  KILN_CHECK(val_fraction == 0.0 || !ids[1].empty(), "data",
             "{}: too few documents ({}) for a validation split at data.val_fraction = {}; "
             "add documents, raise data.val_fraction, or set it to 0", origin, n, val_fraction);
  train_ = TokenizedSplit::build(ids[0], split_tokens[0]);
  validation_ = TokenizedSplit::build(ids[1], split_tokens[1]);
}

}  // namespace kiln

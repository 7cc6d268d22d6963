#include "data/dataset.h"

#include "core/checksum.h"
#include "core/error.h"
#include "data/data_format.h"
#include "data/shards/token_corpus.h"

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

bool is_validation_hash(uint64_t hash, double val_fraction) {
  const auto threshold = static_cast<uint64_t>(std::llround(val_fraction * 1'000'000.0));
  return hash % 1'000'000 < threshold;
}

bool is_validation_document(std::string_view text, double val_fraction) {
  return is_validation_hash(fnv1a64(text), val_fraction);
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
  size_t total = 0;
  for (const auto& t : tokens) total += t.size();
  auto storage = std::make_shared<std::vector<int32_t>>();
  storage->reserve(total);
  uint64_t hash = fnv1a64_value(ids.size(), 0xcbf29ce484222325ull);
  for (size_t i = 0; i < tokens.size(); ++i) {
    storage->insert(storage->end(), tokens[i].begin(), tokens[i].end());
    hash = fnv1a64_value(ids[i], hash);
    hash = fnv1a64_value(tokens[i].size(), hash);
    hash = fnv1a64(std::string_view(reinterpret_cast<const char*>(tokens[i].data()), tokens[i].size() * sizeof(int32_t)),
                   hash);
  }
  TokenizedSplit s;
  const TokenSpan all{std::span<const int32_t>(*storage)};
  const uint32_t segment = s.add_segment(all, storage);
  s.reserve_documents(tokens.size());
  uint64_t begin = 0;
  for (size_t i = 0; i < tokens.size(); ++i) {
    s.add_document(segment, begin, begin + tokens[i].size(), ids[i]);
    begin += tokens[i].size();
  }
  s.fingerprint_ = hash;
  return s;
}

uint32_t TokenizedSplit::add_segment(TokenSpan tokens, std::shared_ptr<const void> owner) {
  segments_.push_back(tokens);
  owners_.push_back(std::move(owner));
  return static_cast<uint32_t>(segments_.size() - 1);
}

void TokenizedSplit::add_document(uint32_t segment, uint64_t begin, uint64_t end, uint64_t id) {
  KILN_CHECK(segment < segments_.size() && begin <= end && end <= segments_[segment].size(), "data",
             "document [{}, {}) outside segment {}", begin, end, segment);
  KILN_CHECK(end - begin <= UINT32_MAX, "data", "document {} has {} tokens, more than 2^32", id, end - begin);
  docs_.push_back(DocRef{begin, static_cast<uint32_t>(end - begin), segment, id});
  num_tokens_ += static_cast<int64_t>(end - begin);
}

uint64_t TokenizedSplit::layout_hash(uint64_t seed) const {
  static_assert(sizeof(DocRef) == 24, "DocRef is hashed as bytes");
  Xxh64 h(seed);
  const uint64_t n = docs_.size();
  h.update(&n, sizeof(n));
  h.update(docs_.data(), docs_.size() * sizeof(DocRef));
  return h.digest();
}

std::vector<std::vector<int32_t>> tokenize_documents(const std::vector<Document>& documents, const Tokenizer& tokenizer) {
  const auto n = static_cast<int64_t>(documents.size());
  std::vector<std::vector<int32_t>> tokens(documents.size());
#pragma omp parallel for schedule(dynamic, 64)
  for (int64_t i = 0; i < n; ++i) tokens[static_cast<size_t>(i)] = tokenizer.encode(documents[static_cast<size_t>(i)].text);
  return tokens;
}

namespace {

// Every document of a text/JSONL path, tokenized, in one split.
TokenizedSplit tokenize_all(const std::vector<Document>& docs, const Tokenizer& tokenizer) {
  std::vector<uint64_t> ids;
  ids.reserve(docs.size());
  for (const Document& d : docs) ids.push_back(d.id);
  return TokenizedSplit::build(ids, tokenize_documents(docs, tokenizer));
}

// Every document of `path` (any format) in one split: data.val_path.
TokenizedSplit read_whole(const std::string& path, const DataConfig& config, const Tokenizer& tokenizer,
                          BadInputLog& log) {
  DataConfig c = config;
  c.path = path;
  const DataFormat format = resolve_data_format(c);
  if (is_token_format(format)) return load_token_documents(path, format, c, tokenizer, log);
  return tokenize_all(read_documents(c, log), tokenizer);
}

}  // namespace

TokenDataset::TokenDataset(const DataConfig& config, const Tokenizer& tokenizer) {
  if (!config.sources.empty()) {
    *this = read_mixture(config, tokenizer);
    return;
  }
  KILN_CHECK(config.val_fraction >= 0.0 && config.val_fraction < 1.0, "data.val_fraction", "must be in [0, 1), got {}",
             config.val_fraction);
  BadInputLog log(config.lenient);
  const DataFormat format = resolve_data_format(config);
  const std::string origin = "'" + config.path + "'";
  if (!config.val_path.empty()) {
    // Validation from its own files; every document of data.path trains.
    if (is_token_format(format)) {
      train_ = load_token_splits(config.path, format, config, 0.0, tokenizer, log).train;
    } else {
      train_ = tokenize_all(read_documents(config, log), tokenizer);
    }
    validation_ = read_whole(config.val_path, config, tokenizer, log);
    KILN_CHECK(validation_.num_documents() > 0, "data.val_path", "'{}' contains no documents", config.val_path);
  } else if (is_token_format(format)) {
    TokenSplits splits = load_token_splits(config.path, format, config, config.val_fraction, tokenizer, log);
    train_ = std::move(splits.train);
    validation_ = std::move(splits.validation);
    KILN_CHECK(format == DataFormat::shards || config.val_fraction == 0.0 || validation_.num_documents() > 0, "data",
               "{}: too few documents ({}) for a validation split at data.val_fraction = {}; "
               "add documents, raise data.val_fraction, or set it to 0", origin, train_.num_documents(),
               config.val_fraction);
  } else {
    *this = TokenDataset(read_documents(config, log), config.val_fraction, tokenizer, origin);
  }
  KILN_CHECK(train_.num_documents() > 0, "data", "{} has no training documents", origin);
  skipped_ = log.counts();
  skipped_summary_ = log.summary();
}

TokenDataset::TokenDataset(std::vector<Document> documents, double val_fraction, const Tokenizer& tokenizer,
                           const std::string& origin) {
  KILN_CHECK(val_fraction >= 0.0 && val_fraction < 1.0, "data.val_fraction", "must be in [0, 1), got {}", val_fraction);
  const auto n = static_cast<int64_t>(documents.size());
  KILN_CHECK(n > 0, "data", "{} contains no documents", origin);

  // Tokenize once, in parallel: documents are independent and encode() is const.
  std::vector<std::vector<int32_t>> tokens = tokenize_documents(documents, tokenizer);
  std::vector<uint64_t> ids[2];
  std::vector<std::vector<int32_t>> split_tokens[2];
  for (int64_t i = 0; i < n; ++i) {
    const Document& doc = documents[static_cast<size_t>(i)];
    const int side = is_validation_document(doc.text, val_fraction) ? 1 : 0;
    ids[side].push_back(doc.id);
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

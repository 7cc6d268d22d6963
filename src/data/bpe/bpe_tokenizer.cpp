#include "data/bpe/bpe_tokenizer.h"

#include "core/error.h"

#include <algorithm>

namespace kiln::bpe {

BpeTokenizer::BpeTokenizer(BpeTokenizerParts parts) : parts_(std::move(parts)) {
  KILN_CHECK(parts_.model != nullptr, "tokenizer", "{}: no BPE model", parts_.origin);
  // In 64 bits and bounded: an added id of INT32_MAX made `id + 1` wrap negative, the
  // tables came out empty and the writes below went past their end.
  auto size = static_cast<int64_t>(parts_.id_to_bytes.size());
  KILN_CHECK(size <= kMaxTokenizerIds, "tokenizer", "{}: {} model ids exceed kiln's limit of {}", parts_.origin, size,
             kMaxTokenizerIds);
  for (const AddedToken& t : parts_.added) {
    KILN_CHECK(t.id >= 0 && t.id < kMaxTokenizerIds, "tokenizer", "{}: added token '{}' has id {} outside [0, {})",
               parts_.origin, t.content, t.id, kMaxTokenizerIds);
    size = std::max(size, int64_t{t.id} + 1);
  }
  kind_.assign(static_cast<size_t>(size), kUnused);
  text_.assign(static_cast<size_t>(size), std::string());
  for (size_t id = 0; id < parts_.id_to_bytes.size(); ++id) {
    if (parts_.id_to_bytes[id].empty()) continue;
    kind_[id] = kModel;
    text_[id] = parts_.id_to_bytes[id];
  }
  std::vector<const AddedToken*> raw, normalized;
  std::vector<std::string> raw_patterns, normalized_patterns;
  for (const AddedToken& t : parts_.added) {
    kind_[static_cast<size_t>(t.id)] = t.special ? kSkipped : kAdded;
    text_[static_cast<size_t>(t.id)] = t.content;
    if (t.normalized) {
      std::string pattern;
      if (!parts_.normalizer.apply(t.content, pattern)) pattern = t.content;
      normalized.push_back(&t);
      normalized_patterns.push_back(std::move(pattern));
    } else {
      raw.push_back(&t);
      raw_patterns.push_back(t.content);
    }
  }
  raw_matcher_ = AddedTokenMatcher(raw, raw_patterns);
  normalized_matcher_ = AddedTokenMatcher(normalized, normalized_patterns);
  for (const int32_t id : {parts_.bos_id, parts_.eos_id, parts_.pad_id}) {
    KILN_CHECK(id >= 0 && id < size, "tokenizer", "{}: special id {} is outside the vocabulary [0, {})",
               parts_.origin, id, size);
    kind_[static_cast<size_t>(id)] = kSkipped;
  }
}

void BpeTokenizer::encode_normalized(std::string_view text, std::vector<int32_t>& out) const {
  parts_.pretokenizer.run(text, [&](std::string_view piece) { parts_.model->encode_word(piece, out); });
}

void BpeTokenizer::encode_segment(std::string_view text, std::vector<int32_t>& out) const {
  if (text.empty()) return;
  std::string normalized;
  if (parts_.normalizer.apply(text, normalized)) text = normalized;
  normalized_matcher_.encode_around(text, out, [&](std::string_view stretch) { encode_normalized(stretch, out); });
}

std::vector<int32_t> BpeTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 4);
  raw_matcher_.encode_around(text, out, [&](std::string_view stretch) { encode_segment(stretch, out); });
  return out;
}

const std::string& BpeTokenizer::token_bytes(int32_t id) const {
  if (id < 0 || id >= vocab_size())
    fail("data.tokenizer", "id {} is outside the vocabulary [0, {}) of {}", id, vocab_size(), parts_.origin);
  return text_[static_cast<size_t>(id)];
}

std::string BpeTokenizer::decode(std::span<const int32_t> ids) const {
  std::string text;
  text.reserve(ids.size() * 4);
  for (const int32_t id : ids) {
    if (id < 0 || id >= vocab_size())
      fail("data.tokenizer", "id {} is outside the vocabulary [0, {}) of {}", id, vocab_size(), parts_.origin);
    if (kind_[static_cast<size_t>(id)] != kSkipped) text += text_[static_cast<size_t>(id)];
  }
  return text;
}

}  // namespace kiln::bpe

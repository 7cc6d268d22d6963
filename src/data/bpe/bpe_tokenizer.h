// BpeTokenizer: a byte-level BPE tokenizer as a Hugging Face tokenizer.json describes it
// (GPT-2, Llama-3, Qwen2/3 and kiln's own `train-tokenizer` output).
//
// encode() runs the `tokenizers` pipeline with add_special_tokens=False: added tokens
// are split out of the raw text (those with normalized=false), the rest is normalized,
// normalized added tokens are split out, the pre-tokenizer cuts pretokens, and the BPE
// model merges inside each. The post-processor (BOS/EOS templates) is not applied: kiln's
// packer adds BOS/EOS itself. decode() is the ByteLevel decoder on raw bytes, without
// the lossy UTF-8 repair, so decode(encode(x)) == x for any bytes when there is no
// normalizer; special tokens (and BOS/EOS/PAD) are skipped, other added tokens are
// written as their content.
#pragma once

#include "data/bpe/added_tokens.h"
#include "data/bpe/bpe_model.h"
#include "data/bpe/normalizer.h"
#include "data/bpe/pretokenizer.h"
#include "data/tokenizer.h"

#include <memory>
#include <string>
#include <vector>

namespace kiln::bpe {

struct BpeTokenizerParts {
  std::string origin;                    // the file, for messages
  std::vector<std::string> id_to_bytes;  // each model token's raw bytes ("" for ids it lacks)
  std::unique_ptr<BpeModel> model;
  std::vector<AddedToken> added;
  Normalizer normalizer;
  PreTokenizer pretokenizer;
  int32_t bos_id = -1, eos_id = -1, pad_id = -1;
};

class BpeTokenizer final : public Tokenizer {
 public:
  explicit BpeTokenizer(BpeTokenizerParts parts);

  std::vector<int32_t> encode(std::string_view text) const override;
  std::string decode(std::span<const int32_t> ids) const override;
  int32_t vocab_size() const override { return static_cast<int32_t>(kind_.size()); }
  int32_t bos_id() const override { return parts_.bos_id; }
  int32_t eos_id() const override { return parts_.eos_id; }
  int32_t pad_id() const override { return parts_.pad_id; }
  std::string name() const override { return "bpe"; }

  const std::string& origin() const { return parts_.origin; }
  const std::vector<AddedToken>& added_tokens() const { return parts_.added; }
  // The raw bytes (model tokens) or content (added tokens) of an id; "" when unused.
  // Throws for an id outside [0, vocab_size()).
  const std::string& token_bytes(int32_t id) const;
  const BpeModel& model() const { return *parts_.model; }

 private:
  enum Kind : uint8_t { kUnused, kModel, kAdded, kSkipped };
  void encode_segment(std::string_view text, std::vector<int32_t>& out) const;
  void encode_normalized(std::string_view text, std::vector<int32_t>& out) const;

  BpeTokenizerParts parts_;
  AddedTokenMatcher raw_matcher_;         // added tokens with normalized = false
  AddedTokenMatcher normalized_matcher_;  // normalized = true, matched after normalization
  std::vector<Kind> kind_;
  std::vector<std::string> text_;
};

// The most token ids kiln reads from a tokenizer.json: eight times the largest vocabulary in
// use (Gemma 3's 262,144). The tokenizer keeps a table entry per id up to the largest, so
// this bounds what a few bytes of a hostile file can make it allocate.
inline constexpr int32_t kMaxTokenizerIds = 1 << 21;

// Every id of a tokenizer.json must be below `end`: kiln's bound, or the vocabulary of
// the model it serves where the caller knows it.
struct TokenIdLimit {
  int64_t end = kMaxTokenizerIds;
  std::string source = "kiln's limit for a tokenizer.json";  // what sets `end`, for errors
  // model.vocab_size (described by `source`), or kiln's bound when that is smaller.
  static TokenIdLimit of_model(int64_t vocab_size, std::string source);
};

// Loads a tokenizer.json (or a folder holding one). BOS/EOS/PAD come from a
// tokenizer_config.json beside it when present, else from well-known token names
// (<|endoftext|>, <|begin_of_text|>, <s>, ...); BOS and PAD default to EOS. Throws
// kiln::Error("[tokenizer] FILE: ...") naming anything unsupported, any field of the wrong
// type ("added_tokens[3].id must be an integer, got ...") and any id outside `limit`.
std::unique_ptr<BpeTokenizer> load_tokenizer_json(const std::string& path, const TokenIdLimit& limit = {});

}  // namespace kiln::bpe

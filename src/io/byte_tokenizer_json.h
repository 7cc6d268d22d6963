// kiln's byte-level tokenizer as Hugging Face tokenizer files (tokenizer.json,
// tokenizer_config.json) and as GGUF's "gpt2" vocabulary.
//
// The vocabulary reproduces kiln's ids exactly: id b (0..255) is the single character
// GPT-2's byte->unicode map assigns to byte b, a BPE model with no merges, a ByteLevel
// pre-tokenizer with use_regex = false (so no splitting can change an id) and a ByteLevel
// decoder; BOS/EOS/PAD (256/257/258) are added special tokens. A post-processor puts BOS
// in front of each sequence, as kiln trains every document to start with BOS
// (add_special_tokens=False gives the bare byte ids).
#pragma once

#include "data/tokenizer.h"

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

namespace kiln::io {

// GPT-2's printable character for byte b, UTF-8 encoded ("A" for 'A', "Ġ" for ' ').
std::string gpt2_byte_char(uint8_t b);

// The special tokens' texts in tokenizer files.
inline constexpr const char* kBosText = "<|bos|>";
inline constexpr const char* kEosText = "<|eos|>";
inline constexpr const char* kPadText = "<|pad|>";

// True if `tokenizer` is kiln's byte-level tokenizer (the only one these files describe).
bool is_byte_tokenizer(const Tokenizer& tokenizer);

nlohmann::json byte_tokenizer_json();
// tokenizer_config.json: PreTrainedTokenizerFast over tokenizer.json, no remote code.
nlohmann::json byte_tokenizer_config_json(int64_t model_max_length);

// True if a parsed tokenizer.json is the one byte_tokenizer_json() writes (same vocabulary,
// specials and pipeline), so a model importing it can use kiln's byte tokenizer.
bool is_byte_tokenizer_json(const nlohmann::json& tokenizer_json);

// GGUF vocabulary ("gpt2" model): one text and type per id for `vocab_size` ids (>= 259;
// ids past 258 are unused padding rows of the embedding). Types: 1 normal, 3 control, 5 unused.
struct GgufVocab {
  std::vector<std::string> tokens;
  std::vector<int32_t> types;
};
GgufVocab byte_gguf_vocab(int64_t vocab_size);

}  // namespace kiln::io

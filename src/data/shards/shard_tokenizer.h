// A shard set's own tokenizer. `kiln tokenize` copies the tokenizer's file (and the
// tokenizer_config.json that gives its special ids) beside the manifest and records it
// there, so training on shards needs only data.path: adopt_shard_tokenizer fills
// data.tokenizer and model.vocab_size from the manifest where the user chose neither, and
// refuses a choice that contradicts it. Shards made before carry no file: their BPE
// tokenizer must still be given (a byte-level one needs no file, so it is adopted).
#pragma once

#include "config/config.h"
#include "data/shards/manifest.h"
#include "data/tokenizer.h"

#include <string>

namespace kiln {

inline constexpr const char* kShardTokenizerFile = "tokenizer.json";

// Copies the tokenizer of data.tokenizer = `setting` into `dir` as tokenizer.json (with
// its tokenizer_config.json and special_tokens_map.json where they exist) and records it
// in `manifest`; checks that the copy is `tokenizer`. Nothing for one that needs no file.
void store_shard_tokenizer(const std::string& setting, const Tokenizer& tokenizer, const std::string& dir,
                           Manifest& manifest);

// data.path, or each of data.sources, that names kiln shards: data.tokenizer and
// model.vocab_size from their manifest unless Config::chosen holds them; a chosen tokenizer
// other than the shards', a model.vocab_size below theirs, or sources made with different
// tokenizers are refused naming both. Anything else is left to the loader.
void adopt_shard_tokenizer(Config& config);

}  // namespace kiln

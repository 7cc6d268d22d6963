// Pre-tokenized data as TokenizedSplits: kiln shard directories (split by their
// manifest), llm.c .bin files and raw token files (split by a hash of each document's
// tokens). Files are memory-mapped and validated in parallel; documents point into the
// mappings, so nothing the size of the corpus is copied.
#pragma once

#include "data/bad_input.h"
#include "data/data_format.h"
#include "data/dataset.h"
#include "data/tokenizer.h"
#include "config/config.h"

#include <string>

namespace kiln {

struct TokenSplits {
  TokenizedSplit train;
  TokenizedSplit validation;
};

// `path` in `format` (shards, llmc, raw_u16, raw_u32). Shards: the manifest's splits
// (`val_fraction` is not used: `kiln tokenize` split them); their tokenizer must be
// `tokenizer` (same fingerprint). Other formats: documents delimited by data.eot_id (-1
// = the tokenizer's BOS), split by is_validation_hash(XXH64 of the document's stored
// tokens, val_fraction). Every token must be below tokenizer.vocab_size().
TokenSplits load_token_splits(const std::string& path, DataFormat format, const DataConfig& config, double val_fraction,
                              const Tokenizer& tokenizer, BadInputLog& log);
// Every document of `path` in one split (shards: train then validation shards).
TokenizedSplit load_token_documents(const std::string& path, DataFormat format, const DataConfig& config,
                                    const Tokenizer& tokenizer, BadInputLog& log);

// The directory of a shard set from data.path: the directory itself or the manifest's.
// Throws for a single .kiln file ("read shards through their manifest").
std::string shard_directory(const std::string& path);

}  // namespace kiln

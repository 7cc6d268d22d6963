// Text corpus -> kiln shards (`kiln tokenize`): streaming, multi-threaded, deterministic.
//
// A reader thread pulls documents from data.path (files, directories, globs; .zst/.gz)
// in chunks; each chunk is tokenized in parallel, split into train/validation by the
// hash of each document's text (the same rule TokenDataset applies to text, so shards
// train exactly like the text read directly), and written in order into shards of about
// `shard_tokens` tokens (documents are never cut). Memory is bounded by a few chunks,
// not by the corpus. The manifest is written last.
#pragma once

#include "data/bad_input.h"
#include "data/shards/manifest.h"
#include "data/tokenizer.h"
#include "config/config.h"

#include <cstdint>
#include <functional>
#include <string>

namespace kiln {

struct TokenizeOptions {
  DataConfig data;                        // path, format, text_key, doc_separator, val_fraction, lenient
  std::string out_dir;                    // created; must not already hold shards
  int64_t shard_tokens = int64_t{1} << 27;  // a shard is closed once it holds this many tokens
  int64_t chunk_bytes = int64_t{16} << 20;  // text per parallel tokenization batch
  int64_t threads = 0;                    // tokenizer threads; 0 = OpenMP's default
};

struct TokenizeReport {
  uint64_t input_documents = 0;  // documents read (after skipping bad input)
  uint64_t input_bytes = 0;      // their text bytes
  double seconds = 0;
  std::string skipped_summary = "none";
  Manifest manifest;             // counts per split, shards, skipped counts
};

// Tokenizes options.data.path into options.out_dir. `progress`, when set, is called
// after each chunk with the report so far (manifest counts are running totals).
TokenizeReport tokenize_to_shards(const TokenizeOptions& options, const Tokenizer& tokenizer,
                                  const std::function<void(const TokenizeReport&)>& progress = {});

}  // namespace kiln

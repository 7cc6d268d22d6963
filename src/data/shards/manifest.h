// manifest.json of a kiln shard directory: which shards make each split, their counts
// and content hashes, and the tokenizer that made them. Written by `kiln tokenize`
// last (after every shard is complete), so a directory with a manifest is whole.
//
//   {"format": "kiln-shards", "version": 1,
//    "tokenizer": {"name": "byte", "vocab_size": 259, "hash": "<16 hex>",
//                  "bos_id": 256, "eos_id": 257, "pad_id": 258,
//                  "file": "tokenizer.json", "file_hash": "<16 hex>"},  (a file's tokenizer, copied beside
//                                                               the manifest; absent in shards made before)
//    "token_bytes": 2,
//    "source": {"path": ..., "format": ..., "text_key": ..., "doc_separator": ..., "val_fraction": ...},
//    "splits": {"train":      {"documents": N, "tokens": M, "shards": [
//                                {"file": "train_000000.kiln", "documents": n, "tokens": m, "hash": "<16 hex>"}, ...]},
//               "validation": {...}},
//    "skipped": {"malformed_json": 0, ...},          (bad input tokenize skipped, lenient)
//    "fingerprint": "<16 hex>"}                        (hash of the tokenizer and every shard hash)
//
// 64-bit values are hex strings: JSON numbers above 2^53 do not survive most readers.
#pragma once

#include "data/bad_input.h"
#include "data/tokenizer.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace kiln {

inline constexpr int kManifestVersion = 1;
inline constexpr const char* kManifestName = "manifest.json";

struct ShardInfo {
  std::string file;  // relative to the manifest's directory
  uint64_t documents = 0;
  uint64_t tokens = 0;
  uint64_t hash = 0;  // XXH64 of the shard after its header (kiln_shard.h)
};

struct ManifestSplit {
  uint64_t documents = 0;
  uint64_t tokens = 0;
  std::vector<ShardInfo> shards;
};

struct Manifest {
  std::string tokenizer_name;
  uint64_t vocab_size = 0;
  uint64_t tokenizer_hash = 0;
  int64_t bos_id = 0, eos_id = 0, pad_id = 0;
  // The tokenizer's own file, beside the manifest (data/shards/shard_tokenizer.h), and the
  // XXH64 of its bytes; "" for a tokenizer that needs no file ("byte") and in older shards.
  std::string tokenizer_file;
  uint64_t tokenizer_file_hash = 0;
  int token_bytes = 4;
  nlohmann::json source = nlohmann::json::object();
  ManifestSplit train;
  ManifestSplit validation;
  BadInputCounts skipped;
  uint64_t fingerprint = 0;

  // Hash of the tokenizer hash and every shard's hash, in split and file order.
  uint64_t compute_fingerprint() const;
};

// Writes `manifest` as `path` (via a temporary file and a rename).
void write_manifest(const std::string& path, const Manifest& manifest);
// Reads and checks `path`: well-formed, known version, split totals equal the sums over
// their shards, fingerprint matches. Throws "[data] PATH: ..." otherwise: a manifest
// that contradicts itself is an error even in lenient mode.
Manifest read_manifest(const std::string& path);

// Identifies a tokenizer by what it does: name, vocabulary size, special ids, the bytes
// of every id and the encoding of a probe text. Shards record it; training on shards
// with another tokenizer is an error.
uint64_t tokenizer_fingerprint(const Tokenizer& tokenizer);

}  // namespace kiln

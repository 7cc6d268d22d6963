// kiln's pre-tokenized shard file (.kiln), written by `kiln tokenize`, read by mmap.
//
//   offset 0   header, 64 bytes, little-endian:
//                char[8] magic "KILNSHRD" | u32 version (1) | u32 token_bytes (2 or 4)
//                u64 documents | u64 tokens | u64 vocab_size | u64 tokenizer_hash
//                u64 content_hash (XXH64 of every byte after the header) | u64 reserved (0)
//   offset 64  tokens: `tokens` ids of token_bytes each (uint16 when vocab <= 65536)
//              zero padding to a multiple of 8 bytes
//   then       document index: documents + 1 u64 token offsets (0, ..., tokens);
//              document i is tokens [index[i], index[i+1]), content only (no BOS/EOS)
//
// The index follows the tokens so the writer streams: tokens go out as documents come
// in, the index (8 bytes a document) is written at the end and the header patched.
#pragma once

#include "core/checksum.h"
#include "data/shards/manifest.h"
#include "data/shards/token_file.h"

#include <cstdio>
#include <span>
#include <string>
#include <vector>

namespace kiln {

inline constexpr char kShardMagic[8] = {'K', 'I', 'L', 'N', 'S', 'H', 'R', 'D'};
inline constexpr uint32_t kShardVersion = 1;
inline constexpr size_t kShardHeaderBytes = 64;

// Bytes per token for a vocabulary: 2 when every id fits uint16, else 4.
inline int shard_token_bytes(int64_t vocab_size) { return vocab_size <= 65536 ? 2 : 4; }

class ShardWriter {
 public:
  // Creates `path` (truncating). Throws "[data] cannot write 'PATH'".
  ShardWriter(std::string path, int token_bytes, uint64_t vocab_size, uint64_t tokenizer_hash);
  ~ShardWriter();
  ShardWriter(const ShardWriter&) = delete;
  ShardWriter& operator=(const ShardWriter&) = delete;

  void add_document(std::span<const int32_t> tokens);
  // Writes the index and the final header, closes the file; returns its manifest entry
  // (file name without directory).
  ShardInfo finish();

  uint64_t documents() const { return offsets_.size() - 1; }
  uint64_t tokens() const { return offsets_.back(); }

 private:
  void write(const void* data, size_t bytes, bool hash = true);

  std::string path_;
  int token_bytes_;
  uint64_t vocab_size_;
  uint64_t tokenizer_hash_;
  std::FILE* file_ = nullptr;
  Xxh64 hash_;
  std::vector<uint64_t> offsets_{0};
  std::vector<unsigned char> buffer_;
};

// Maps and validates one shard against its manifest entry and `manifest` (token width,
// vocabulary, tokenizer). Bad input: a file shorter or longer than its header says
// (truncated), a wrong magic or version, a header or content hash that disagrees with
// the manifest (manifest mismatch), a document index out of order, an empty document, a
// token >= vocab_size. In lenient mode a bad file is skipped whole, a bad document alone.
TokenFile open_kiln_shard(const std::string& path, const ShardInfo& expected, const Manifest& manifest,
                          int64_t vocab_size, BadInputLog& log);

}  // namespace kiln

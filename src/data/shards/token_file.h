// Token files on disk: a read-only memory map and the documents found in it, shared by
// the three pre-tokenized formats (kiln shards, llm.c .bin, raw uint16/uint32 files).
//
// Nothing is copied: a TokenizedSplit points into the mapping, and the page cache holds
// what the packer touches, so a corpus larger than memory trains.
#pragma once

#include "data/bad_input.h"
#include "data/token_span.h"

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace kiln {

class MappedFile {
 public:
  // Maps `path` read-only (an empty file maps to nothing); throws "[data] cannot open 'PATH'".
  static std::shared_ptr<const MappedFile> open(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const unsigned char* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  MappedFile() = default;
  std::string path_;
  const unsigned char* data_ = nullptr;
  size_t size_ = 0;
};

struct DocRange {
  uint64_t begin = 0;  // token index of the first token
  uint64_t end = 0;    // one past the last
};

// One validated token file.
struct TokenFile {
  std::string path;
  std::shared_ptr<const MappedFile> file;
  TokenSpan tokens;            // every token of the file, in place
  uint64_t token_offset = 0;   // byte offset of tokens[0] in the file, for messages
  std::vector<DocRange> docs;  // the documents kept, in file order
  uint64_t content_hash = 0;   // identifies the content (fingerprints, manifests)
  bool skipped = false;        // lenient mode skipped the whole file (bad header, ...)

  // "PATH:offset N" for token i.
  std::string where(uint64_t token_index) const;
};

// Splits file.tokens at `delimiter` into file.docs: each document is a maximal run of
// other ids (the delimiter belongs to none; empty runs are dropped). Every id must be
// below `vocab_size`: a bad id is reported with its byte offset, and in lenient mode
// its document is skipped.
void split_at_delimiter(TokenFile& file, int32_t delimiter, int64_t vocab_size, BadInputLog& log);
// Checks the ids of file.docs against `vocab_size` and that none is empty; in lenient
// mode a bad document is dropped from file.docs.
void check_documents(TokenFile& file, int64_t vocab_size, BadInputLog& log);

// Opens `paths` with `open_one` (several files at once), then merges what each reported
// into `log` in file order, so strict mode names the first bad file in path order and
// lenient mode's first locations are those of a sequential read.
using OpenTokenFile = std::function<TokenFile(const std::string& path, BadInputLog& log)>;
std::vector<TokenFile> open_token_files(const std::vector<std::string>& paths, const OpenTokenFile& open_one,
                                        BadInputLog& log);

// XXH64 of `bytes` (core/checksum.h's streaming Xxh64), for content hashes.
uint64_t hash_bytes(const void* data, size_t bytes, uint64_t seed = 0);

// Little-endian reads from a mapped header.
uint32_t load_u32(const unsigned char* p);
uint64_t load_u64(const unsigned char* p);

}  // namespace kiln

#include "data/shards/kiln_shard.h"

#include "core/error.h"

#include <fmt/format.h>

#include <cstring>
#include <filesystem>

namespace kiln {

namespace {

void store_u32(unsigned char* p, uint32_t v) { std::memcpy(p, &v, sizeof(v)); }
void store_u64(unsigned char* p, uint64_t v) { std::memcpy(p, &v, sizeof(v)); }

uint64_t padded(uint64_t bytes) { return (bytes + 7) / 8 * 8; }

}  // namespace

ShardWriter::ShardWriter(std::string path, int token_bytes, uint64_t vocab_size, uint64_t tokenizer_hash)
    : path_(std::move(path)), token_bytes_(token_bytes), vocab_size_(vocab_size), tokenizer_hash_(tokenizer_hash) {
  KILN_CHECK(token_bytes_ == 2 || token_bytes_ == 4, "data", "shard token width must be 2 or 4 bytes, got {}", token_bytes_);
  file_ = std::fopen(path_.c_str(), "wb");
  if (file_ == nullptr) fail("data", "cannot write '{}'", path_);
  const unsigned char zeros[kShardHeaderBytes] = {};
  write(zeros, sizeof(zeros), /*hash=*/false);  // patched by finish()
}

ShardWriter::~ShardWriter() {
  if (file_ != nullptr) std::fclose(file_);
}

void ShardWriter::write(const void* data, size_t bytes, bool hash) {
  if (bytes == 0) return;
  if (std::fwrite(data, 1, bytes, file_) != bytes) fail("data", "cannot write '{}' (disk full?)", path_);
  if (hash) hash_.update(data, bytes);
}

void ShardWriter::add_document(std::span<const int32_t> tokens) {
  KILN_CHECK(file_ != nullptr, "data", "{}: add_document after finish", path_);
  buffer_.resize(tokens.size() * static_cast<size_t>(token_bytes_));
  for (size_t i = 0; i < tokens.size(); ++i) {
    const int32_t id = tokens[i];
    KILN_CHECK(id >= 0 && static_cast<uint64_t>(id) < vocab_size_, "data", "{}: token {} outside the vocabulary of {}",
               path_, id, vocab_size_);
    if (token_bytes_ == 2) {
      const auto v = static_cast<uint16_t>(id);
      std::memcpy(buffer_.data() + 2 * i, &v, 2);
    } else {
      const auto v = static_cast<uint32_t>(id);
      std::memcpy(buffer_.data() + 4 * i, &v, 4);
    }
  }
  write(buffer_.data(), buffer_.size());
  offsets_.push_back(offsets_.back() + tokens.size());
}

ShardInfo ShardWriter::finish() {
  KILN_CHECK(file_ != nullptr, "data", "{}: finish called twice", path_);
  const uint64_t token_bytes = tokens() * static_cast<uint64_t>(token_bytes_);
  const unsigned char zeros[8] = {};
  write(zeros, padded(token_bytes) - token_bytes);
  write(offsets_.data(), offsets_.size() * sizeof(uint64_t));

  ShardInfo info;
  info.file = std::filesystem::path(path_).filename().string();
  info.documents = documents();
  info.tokens = tokens();
  info.hash = hash_.digest();

  unsigned char header[kShardHeaderBytes] = {};
  std::memcpy(header, kShardMagic, sizeof(kShardMagic));
  store_u32(header + 8, kShardVersion);
  store_u32(header + 12, static_cast<uint32_t>(token_bytes_));
  store_u64(header + 16, info.documents);
  store_u64(header + 24, info.tokens);
  store_u64(header + 32, vocab_size_);
  store_u64(header + 40, tokenizer_hash_);
  store_u64(header + 48, info.hash);
  if (std::fseek(file_, 0, SEEK_SET) != 0) fail("data", "cannot write '{}'", path_);
  write(header, sizeof(header), /*hash=*/false);
  bool ok = std::fflush(file_) == 0;
  ok = std::fclose(file_) == 0 && ok;  // close reports write-back errors too
  file_ = nullptr;
  if (!ok) fail("data", "cannot write '{}' (disk full?)", path_);
  return info;
}

TokenFile open_kiln_shard(const std::string& path, const ShardInfo& expected, const Manifest& manifest,
                          int64_t vocab_size, BadInputLog& log) {
  TokenFile f;
  f.path = path;
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) {
    log.report(BadInput::manifest_mismatch, path, "shard listed in the manifest is missing");
    f.skipped = true;
    return f;
  }
  f.file = MappedFile::open(path);
  const unsigned char* p = f.file->data();
  const uint64_t size = f.file->size();
  auto skip = [&](BadInput reason, const std::string& message) {
    log.report(reason, path, message);
    f.skipped = true;
    f.docs.clear();
    return f;
  };
  if (size < kShardHeaderBytes)
    return skip(BadInput::truncated, fmt::format("truncated shard: {} bytes, the header alone is {}", size, kShardHeaderBytes));
  if (std::memcmp(p, kShardMagic, sizeof(kShardMagic)) != 0) return skip(BadInput::bad_header, "wrong magic (not a kiln shard)");
  const uint32_t version = load_u32(p + 8), width = load_u32(p + 12);
  if (version != kShardVersion)
    return skip(BadInput::bad_header, fmt::format("shard version {} is not supported (this kiln reads {})", version, kShardVersion));
  if (width != 2 && width != 4) return skip(BadInput::bad_header, fmt::format("token width {} bytes (must be 2 or 4)", width));
  const uint64_t documents = load_u64(p + 16), tokens = load_u64(p + 24);
  const uint64_t shard_vocab = load_u64(p + 32), tokenizer_hash = load_u64(p + 40), content_hash = load_u64(p + 48);
  // Sizes first (a header from a cut file must not index past the mapping).
  const uint64_t token_end = kShardHeaderBytes + padded(tokens * width);
  if (tokens > size || documents > size || token_end + 8 * (documents + 1) != size)
    return skip(BadInput::truncated, fmt::format("{} shard: {} bytes, the header's {} tokens and {} documents need {}",
                                                 token_end + 8 * (documents + 1) > size ? "truncated" : "oversized", size,
                                                 tokens, documents, token_end + 8 * (documents + 1)));
  auto mismatch = [&](std::string_view what, auto shard_value, auto manifest_value) {
    return skip(BadInput::manifest_mismatch,
                fmt::format("manifest mismatch: the shard has {} {}, the manifest says {}", what, shard_value, manifest_value));
  };
  if (documents != expected.documents) return mismatch("documents", documents, expected.documents);
  if (tokens != expected.tokens) return mismatch("tokens", tokens, expected.tokens);
  if (width != static_cast<uint32_t>(manifest.token_bytes)) return mismatch("token_bytes", width, manifest.token_bytes);
  if (shard_vocab != manifest.vocab_size) return mismatch("vocab_size", shard_vocab, manifest.vocab_size);
  if (tokenizer_hash != manifest.tokenizer_hash)
    return mismatch("tokenizer hash", hex64(tokenizer_hash), hex64(manifest.tokenizer_hash));
  if (content_hash != expected.hash) return mismatch("hash", hex64(content_hash), hex64(expected.hash));
  const uint64_t actual = hash_bytes(p + kShardHeaderBytes, size - kShardHeaderBytes);
  if (actual != content_hash)
    return skip(BadInput::manifest_mismatch,
                fmt::format("manifest mismatch: content hashes to {}, header and manifest say {} (corrupt shard)",
                            hex64(actual), hex64(content_hash)));

  f.token_offset = kShardHeaderBytes;
  if (width == 2) {
    f.tokens = TokenSpan(reinterpret_cast<const uint16_t*>(p + kShardHeaderBytes), tokens);
  } else {
    f.tokens = TokenSpan(reinterpret_cast<const uint32_t*>(p + kShardHeaderBytes), tokens);
  }
  f.content_hash = content_hash;
  const unsigned char* index = p + token_end;
  f.docs.reserve(documents);
  uint64_t previous = load_u64(index);
  if (previous != 0 || load_u64(index + 8 * documents) != tokens)
    return skip(BadInput::bad_header, fmt::format("document index does not span tokens [0, {})", tokens));
  for (uint64_t i = 1; i <= documents; ++i) {
    const uint64_t next = load_u64(index + 8 * i);
    if (next < previous || next > tokens)
      return skip(BadInput::bad_header, fmt::format("document index out of order at document {}", i - 1));
    f.docs.push_back(DocRange{previous, next});
    previous = next;
  }
  check_documents(f, vocab_size, log);
  return f;
}

}  // namespace kiln

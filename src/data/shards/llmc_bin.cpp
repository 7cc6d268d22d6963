#include "data/shards/llmc_bin.h"

#include "core/checksum.h"
#include "core/error.h"

#include <fmt/format.h>

namespace kiln {

TokenFile open_llmc_file(const std::string& path, int32_t eot, int64_t vocab_size, BadInputLog& log) {
  TokenFile f;
  f.path = path;
  f.file = MappedFile::open(path);
  const size_t size = f.file->size();
  const unsigned char* p = f.file->data();
  if (size < kLlmcHeaderBytes) {
    log.report(BadInput::truncated, path, fmt::format("truncated llm.c file: {} bytes, the header alone is {}", size,
                                                      kLlmcHeaderBytes));
    f.skipped = true;
    return f;
  }
  const auto magic = static_cast<int32_t>(load_u32(p));
  const auto version = static_cast<int32_t>(load_u32(p + 4));
  const auto count = static_cast<int32_t>(load_u32(p + 8));
  int width = 0;
  if (magic == kLlmcMagicU16) {
    width = 2;
    if (version != kLlmcVersionU16) {
      log.report(BadInput::bad_header, path, fmt::format("wrong llm.c version {} for magic {} (expected {})", version,
                                                         magic, kLlmcVersionU16));
      f.skipped = true;
      return f;
    }
  } else if (magic == kLlmcMagicU32) {
    width = 4;
    if (version != kLlmcVersionU32) {
      log.report(BadInput::bad_header, path, fmt::format("wrong llm.c version {} for magic {} (expected {})", version,
                                                         magic, kLlmcVersionU32));
      f.skipped = true;
      return f;
    }
  } else {
    log.report(BadInput::bad_header, path,
               fmt::format("wrong magic {} (llm.c .bin has {} or {}; for headerless token files set data.format = "
                           "raw_u16 or raw_u32)", magic, kLlmcMagicU16, kLlmcMagicU32));
    f.skipped = true;
    return f;
  }
  const uint64_t expected = kLlmcHeaderBytes + static_cast<uint64_t>(count < 0 ? 0 : count) * static_cast<uint64_t>(width);
  if (count < 0 || size != expected) {
    log.report(BadInput::truncated, path,
               fmt::format("{} llm.c file: {} bytes, the header's {} tokens of {} bytes need {}",
                           size < expected ? "truncated" : "oversized", size, count, width, expected));
    f.skipped = true;
    return f;
  }
  KILN_CHECK(eot >= 0 && eot < vocab_size && (width == 4 || eot < 65536), "data.eot_id",
             "{} is not a token id of '{}' ({}-bit tokens, vocab {})", eot, path, width * 8, vocab_size);
  f.token_offset = kLlmcHeaderBytes;
  const unsigned char* tokens = p + kLlmcHeaderBytes;
  if (width == 2) {
    f.tokens = TokenSpan(reinterpret_cast<const uint16_t*>(tokens), static_cast<size_t>(count));
  } else {
    f.tokens = TokenSpan(reinterpret_cast<const uint32_t*>(tokens), static_cast<size_t>(count));
  }
  f.content_hash = hash_bytes(p, size, 0x6c6c6d63 /* "llmc" */);
  split_at_delimiter(f, eot, vocab_size, log);
  return f;
}

}  // namespace kiln

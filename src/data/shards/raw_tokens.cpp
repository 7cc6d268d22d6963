#include "data/shards/raw_tokens.h"

#include "core/checksum.h"
#include "core/error.h"

#include <fmt/format.h>

namespace kiln {

TokenFile open_raw_token_file(const std::string& path, int width, int32_t eot, int64_t vocab_size, BadInputLog& log) {
  KILN_CHECK(width == 2 || width == 4, "data", "raw token width must be 2 or 4 bytes, got {}", width);
  TokenFile f;
  f.path = path;
  f.file = MappedFile::open(path);
  const size_t size = f.file->size();
  if (size % static_cast<size_t>(width) != 0) {
    log.report(BadInput::truncated, path,
               fmt::format("truncated token file: {} bytes is not a whole number of {}-byte tokens", size, width));
    f.skipped = true;
    return f;
  }
  KILN_CHECK(eot >= 0 && eot < vocab_size && (width == 4 || eot < 65536), "data.eot_id",
             "{} is not a token id of '{}' ({}-bit tokens, vocab {})", eot, path, width * 8, vocab_size);
  const size_t count = size / static_cast<size_t>(width);
  if (width == 2) {
    f.tokens = TokenSpan(reinterpret_cast<const uint16_t*>(f.file->data()), count);
  } else {
    f.tokens = TokenSpan(reinterpret_cast<const uint32_t*>(f.file->data()), count);
  }
  f.content_hash = hash_bytes(f.file->data(), size, 0x726177 /* "raw" */);
  split_at_delimiter(f, eot, vocab_size, log);
  return f;
}

}  // namespace kiln

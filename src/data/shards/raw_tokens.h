// Raw token files, read-only: nothing but little-endian uint16 (data.format = raw_u16)
// or uint32 (raw_u32) ids, documents delimited by data.eot_id (-1 = tokenizer BOS).
#pragma once

#include "data/shards/token_file.h"

namespace kiln {

// Maps and validates one raw file of `width` (2 or 4) bytes per token. Bad input: a size
// that is not a whole number of tokens (truncated; lenient skips the file), a token >= vocab.
TokenFile open_raw_token_file(const std::string& path, int width, int32_t eot, int64_t vocab_size, BadInputLog& log);

}  // namespace kiln

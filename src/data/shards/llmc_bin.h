// llm.c's .bin token shards, read-only (karpathy/llm.c dev/data/data_common.py):
//
//   header: 256 x int32, little-endian
//     [0] magic    20240520 (GPT-2: uint16 tokens) or 20240801 (Llama 3: uint32 tokens)
//     [1] version  1 with 20240520, 7 with 20240801
//     [2] number of tokens
//   tokens: that many uint16 or uint32 ids, right after the header (offset 1024)
//
// Documents are delimited by an EOT id (llm.c writes it before every document: 50256
// for GPT-2, 128000 <|begin_of_text|> for Llama 3), which data.eot_id sets (-1 = the
// tokenizer's BOS). A document that llm.c cut at a shard boundary reads as two.
#pragma once

#include "data/shards/token_file.h"

namespace kiln {

inline constexpr int32_t kLlmcMagicU16 = 20240520;
inline constexpr int32_t kLlmcVersionU16 = 1;
inline constexpr int32_t kLlmcMagicU32 = 20240801;
inline constexpr int32_t kLlmcVersionU32 = 7;
inline constexpr size_t kLlmcHeaderInts = 256;
inline constexpr size_t kLlmcHeaderBytes = kLlmcHeaderInts * 4;

// Maps and validates one .bin file. Bad input, each named "PATH" or "PATH:offset N": a
// file shorter than its header (truncated), a wrong magic or version, a token >= vocab.
// In lenient mode a bad header or size skips the file (TokenFile::skipped).
TokenFile open_llmc_file(const std::string& path, int32_t eot, int64_t vocab_size, BadInputLog& log);

}  // namespace kiln

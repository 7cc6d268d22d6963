// Which reader a data.path needs: data.format, or for "auto" the path's extension (and
// for a directory, whether it holds a kiln shard manifest).
#pragma once

#include "config/config.h"

#include <string>
#include <string_view>

namespace kiln {

enum class DataFormat {
  text,     // plain text, documents split at data.doc_separator (.txt, anything else)
  jsonl,    // JSON Lines, data.text_key (.jsonl, .json)
  parquet,  // Parquet, the string column data.text_key (.parquet)
  arrow,    // Arrow IPC stream or file, column data.text_key (.arrow: Hugging Face save_to_disk)
  shards,   // kiln's pre-tokenized shards: a directory with manifest.json
  llmc,     // llm.c .bin shards (256 x int32 header), read-only
  raw_u16,  // headerless uint16 tokens, documents delimited by data.eot_id
  raw_u32,  // headerless uint32 tokens
};

// "auto|text|jsonl|parquet|arrow|shards|llmc|raw_u16|raw_u32", the choices of data.format.
inline constexpr std::string_view kDataFormatChoices = "auto|text|jsonl|parquet|arrow|shards|llmc|raw_u16|raw_u32";

std::string_view format_name(DataFormat format);
// Pre-tokenized formats (read as tokens, no tokenizer pass); the others hold documents.
inline bool is_token_format(DataFormat f) {
  return f != DataFormat::text && f != DataFormat::jsonl && f != DataFormat::parquet && f != DataFormat::arrow;
}

// One file by extension, compression suffix (.zst, .gz) stripped, case-insensitive:
// .jsonl/.json -> jsonl, .parquet -> parquet, .arrow -> arrow, .bin -> llmc,
// manifest.json/.kiln -> shards, else text.
DataFormat format_of_file(std::string_view path);

// The format of `path` under data.format `format`. For "auto": a directory holding
// manifest.json (or the manifest itself) -> shards; a directory or glob -> the format
// of its files (document formats -- text, jsonl, parquet, arrow -- may mix: each file is
// read by its own extension; a Hugging Face save_to_disk folder is its .arrow files; token
// files may not mix with them); a file -> format_of_file. Throws naming data.format for
// an unknown name.
DataFormat resolve_data_format(const std::string& path, const std::string& format);
inline DataFormat resolve_data_format(const DataConfig& c) { return resolve_data_format(c.path, c.format); }

}  // namespace kiln

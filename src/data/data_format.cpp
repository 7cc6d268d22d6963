#include "data/data_format.h"

#include "core/error.h"
#include "core/printable.h"
#include "data/readers/compressed.h"
#include "data/readers/glob.h"

#include <algorithm>
#include <cctype>
#include <filesystem>

namespace kiln {

namespace fs = std::filesystem;

namespace {

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

std::string lower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(), [](unsigned char c) { return std::tolower(c); });
  return out;
}

}  // namespace

std::string_view format_name(DataFormat format) {
  switch (format) {
    case DataFormat::text: return "text";
    case DataFormat::jsonl: return "jsonl";
    case DataFormat::parquet: return "parquet";
    case DataFormat::arrow: return "arrow";
    case DataFormat::shards: return "shards";
    case DataFormat::llmc: return "llmc";
    case DataFormat::raw_u16: return "raw_u16";
    case DataFormat::raw_u32: return "raw_u32";
  }
  return "?";
}

DataFormat format_of_file(std::string_view path) {
  const std::string name = lower(strip_compression_extension(path));
  if (ends_with(name, "manifest.json") && (name.size() == 13 || name[name.size() - 14] == '/')) return DataFormat::shards;
  if (ends_with(name, ".jsonl") || ends_with(name, ".json")) return DataFormat::jsonl;
  if (ends_with(name, ".parquet")) return DataFormat::parquet;
  if (ends_with(name, ".arrow")) return DataFormat::arrow;
  if (ends_with(name, ".bin")) return DataFormat::llmc;
  if (ends_with(name, ".kiln")) return DataFormat::shards;
  return DataFormat::text;
}

DataFormat resolve_data_format(const std::string& path, const std::string& format) {
  for (const DataFormat f : {DataFormat::text, DataFormat::jsonl, DataFormat::parquet, DataFormat::arrow,
                             DataFormat::shards, DataFormat::llmc, DataFormat::raw_u16, DataFormat::raw_u32}) {
    if (format == format_name(f)) return f;
  }
  if (format != "auto") fail("data.format", "unknown format '{}' (known: {})", printable(format), kDataFormatChoices);

  std::error_code ec;
  const bool directory = fs::is_directory(path, ec);
  if (directory && fs::exists(fs::path(path) / "manifest.json", ec)) return DataFormat::shards;
  if (!directory && !(is_glob_pattern(path) && !fs::exists(path, ec))) return format_of_file(path);

  // A directory or glob: every file must hold documents (text, JSONL, Parquet, Arrow), or
  // every file be a token file of one format.
  const std::vector<std::string> files = expand_data_path(path);
  const DataFormat first = format_of_file(files.front());
  for (const std::string& file : files) {
    const DataFormat f = format_of_file(file);
    if (is_token_format(f) != is_token_format(first) || (is_token_format(f) && f != first))
      fail("data.format", "'{}' mixes {} files ('{}') and {} files ('{}'); set data.path to one kind", path,
           format_name(first), files.front(), format_name(f), file);
  }
  return first;
}

}  // namespace kiln

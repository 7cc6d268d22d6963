#include "data/readers/text.h"

#include "core/utf8.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>

namespace kiln {

namespace {
bool is_blank(std::string_view s) {
  return std::all_of(s.begin(), s.end(), [](char c) { return std::isspace(static_cast<unsigned char>(c)) != 0; });
}
}  // namespace

TextFileSource::TextFileSource(std::string path, std::string separator, BadInputLog& log)
    : reader_(std::move(path), std::move(separator), log), log_(log) {}

bool TextFileSource::next(Document& doc) {
  std::string_view piece;
  int64_t line = 0;
  while (reader_.next(piece, line)) {
    if (is_blank(piece)) continue;
    const size_t bad = find_invalid_utf8(piece);
    if (bad != std::string_view::npos) {
      const auto bad_line = line + static_cast<int64_t>(std::count(piece.begin(), piece.begin() + bad, '\n'));
      log_.report(BadInput::invalid_utf8, fmt::format("{}:{}", path(), bad_line),
                  fmt::format("invalid UTF-8 (byte 0x{:02x})", static_cast<unsigned char>(piece[bad])));
      continue;
    }
    doc.id = next_id_++;
    doc.text.assign(piece);
    return true;
  }
  return false;
}

}  // namespace kiln

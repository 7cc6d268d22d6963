#include "data/readers/jsonl.h"

#include "core/utf8.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>

namespace kiln {

namespace {

bool is_blank(std::string_view s) {
  return std::all_of(s.begin(), s.end(), [](char c) { return std::isspace(static_cast<unsigned char>(c)) != 0; });
}

// nlohmann prefixes what() with "[json.exception.parse_error.101] "; our message already
// says what kind of error it is, and one "[where]" per line is the house style.
std::string json_reason(const std::exception& e) {
  std::string what = e.what();
  if (!what.empty() && what.front() == '[') {
    const size_t close = what.find("] ");
    if (close != std::string::npos) what = what.substr(close + 2);
  }
  return what;
}

}  // namespace

JsonlFileSource::JsonlFileSource(std::string path, std::string text_key, BadInputLog& log)
    : reader_(std::move(path), "\n", log), text_key_(std::move(text_key)), log_(log) {}

bool JsonlFileSource::next(Document& doc) {
  std::string_view line;
  int64_t line_number = 0;
  while (reader_.next(line, line_number)) {
    if (is_blank(line)) continue;
    auto where = [&] { return fmt::format("{}:{}", path(), line_number); };
    const size_t bad = find_invalid_utf8(line);
    if (bad != std::string_view::npos) {
      log_.report(BadInput::invalid_utf8, where(),
                  fmt::format("invalid UTF-8 (byte 0x{:02x} at column {})", static_cast<unsigned char>(line[bad]), bad + 1));
      continue;
    }
    nlohmann::json object;
    try {
      object = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      log_.report(BadInput::malformed_json, where(), fmt::format("malformed JSON ({})", json_reason(e)));
      continue;
    }
    const auto field = object.is_object() ? object.find(text_key_) : object.end();
    if (!object.is_object() || field == object.end() || !field->is_string()) {
      log_.report(BadInput::missing_text_key, where(), fmt::format("missing string field '{}'", text_key_));
      continue;
    }
    auto& text = field->get_ref<std::string&>();
    if (text.empty()) {
      log_.report(BadInput::empty_document, where(), fmt::format("empty document (field '{}' is \"\")", text_key_));
      continue;
    }
    doc.id = next_id_++;
    doc.text = std::move(text);
    return true;
  }
  return false;
}

}  // namespace kiln

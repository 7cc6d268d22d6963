#include "data/document_reader.h"

#include "core/error.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>

namespace kiln {

namespace {

bool is_blank(std::string_view s) {
  return std::all_of(s.begin(), s.end(), [](char c) { return std::isspace(static_cast<unsigned char>(c)) != 0; });
}

bool ends_with(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
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

std::string read_file_bytes(const std::string& path) {
  // ifstream "opens" a directory on Linux and then reads nothing; reject it up front.
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) fail("data", "cannot open '{}' (a directory)", path);
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("data", "cannot open '{}'", path);
  std::string bytes;
  in.seekg(0, std::ios::end);
  const std::streamoff size = in.tellg();
  if (size > 0) {
    bytes.resize(static_cast<size_t>(size));
    in.seekg(0, std::ios::beg);
    in.read(bytes.data(), size);
    if (!in) fail("data", "cannot read '{}'", path);
  }
  return bytes;
}

TextFileSource::TextFileSource(std::string path, std::string separator)
    : path_(std::move(path)), separator_(std::move(separator)) {
  KILN_CHECK(!separator_.empty(), "data.doc_separator", "must not be empty");
}

std::vector<Document> TextFileSource::read_all() {
  const std::string bytes = read_file_bytes(path_);
  std::vector<Document> docs;
  const std::string_view all(bytes);
  size_t begin = 0;
  while (begin <= all.size()) {
    size_t end = all.find(separator_, begin);
    if (end == std::string_view::npos) end = all.size();
    const std::string_view piece = all.substr(begin, end - begin);
    if (!is_blank(piece)) docs.push_back(Document{docs.size(), std::string(piece)});
    begin = end + separator_.size();
  }
  if (docs.empty()) fail("data", "'{}' contains no documents", path_);
  return docs;
}

JsonlFileSource::JsonlFileSource(std::string path, std::string text_key)
    : path_(std::move(path)), text_key_(std::move(text_key)) {}

std::vector<Document> JsonlFileSource::read_all() {
  const std::string bytes = read_file_bytes(path_);
  std::vector<Document> docs;
  const std::string_view all(bytes);
  size_t begin = 0;
  int64_t line_number = 0;
  while (begin < all.size()) {
    size_t end = all.find('\n', begin);
    if (end == std::string_view::npos) end = all.size();
    const std::string_view line = all.substr(begin, end - begin);
    begin = end + 1;
    ++line_number;
    if (is_blank(line)) continue;

    nlohmann::json object;
    try {
      object = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      fail("data", "{}:{}: malformed JSON ({})", path_, line_number, json_reason(e));
    }
    const auto field = object.is_object() ? object.find(text_key_) : object.end();
    if (!object.is_object() || field == object.end() || !field->is_string()) {
      fail("data", "{}:{}: missing string field '{}'", path_, line_number, text_key_);
    }
    docs.push_back(Document{docs.size(), field->get<std::string>()});
  }
  if (docs.empty()) fail("data", "'{}' contains no documents", path_);
  return docs;
}

std::string resolve_format(const DataConfig& config) {
  if (config.format == "text" || config.format == "jsonl") return config.format;
  if (config.format != "auto") fail("data.format", "unknown format '{}' (known: auto, text, jsonl)", config.format);
  std::string lower = config.path;
  std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
  return ends_with(lower, ".jsonl") || ends_with(lower, ".json") ? "jsonl" : "text";
}

std::unique_ptr<DocumentSource> make_document_source(const DataConfig& config) {
  if (resolve_format(config) == "jsonl") return std::make_unique<JsonlFileSource>(config.path, config.text_key);
  return std::make_unique<TextFileSource>(config.path, config.doc_separator);
}

std::vector<Document> read_documents(const DataConfig& config) { return make_document_source(config)->read_all(); }

}  // namespace kiln

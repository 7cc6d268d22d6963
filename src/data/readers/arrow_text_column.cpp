#include "data/readers/arrow_text_column.h"

#include "core/error.h"
#include "core/utf8.h"

#include <arrow/array.h>
#include <arrow/status.h>
#include <arrow/type.h>
#include <fmt/format.h>

#include <string_view>

namespace kiln {

namespace {

bool is_text_type(const arrow::DataType& type) {
  return type.id() == arrow::Type::STRING || type.id() == arrow::Type::LARGE_STRING;
}

// "id: int64, content: string", the schema as the error messages list it.
std::string columns_of(const arrow::Schema& schema) {
  std::string out;
  for (const auto& field : schema.fields()) {
    if (!out.empty()) out += ", ";
    out += field->name() + ": " + field->type()->ToString();
  }
  return out.empty() ? "none" : out;
}

std::string_view value_at(const arrow::Array& chunk, int64_t i) {
  if (chunk.type_id() == arrow::Type::LARGE_STRING) return static_cast<const arrow::LargeStringArray&>(chunk).GetView(i);
  return static_cast<const arrow::StringArray&>(chunk).GetView(i);
}

}  // namespace

int text_column_index(const arrow::Schema& schema, const std::string& text_key, const std::string& path) {
  const int index = schema.GetFieldIndex(text_key);  // -1 when absent (or ambiguous)
  if (index < 0)
    fail("data", "{}: no column '{}' (columns: {}); set data.text_key", path, text_key, columns_of(schema));
  const arrow::DataType& type = *schema.field(index)->type();
  if (!is_text_type(type))
    fail("data", "{}: column '{}' is {}, not string (columns: {}); set data.text_key", path, text_key, type.ToString(),
         columns_of(schema));
  return index;
}

void check_arrow(const arrow::Status& status, const std::string& path, const std::string& what) {
  if (!status.ok()) fail("data", "{}: {}: {}", path, what, status.ToString());
}

TextColumnRows::TextColumnRows(const std::string& path, std::string text_key, BadInputLog& log)
    : path_(path), text_key_(std::move(text_key)), log_(log) {}

TextColumnRows::~TextColumnRows() = default;

void TextColumnRows::start(std::shared_ptr<arrow::Array> chunk) {
  first_row_ += chunk_ ? chunk_->length() : 0;
  chunk_ = std::move(chunk);
  index_ = 0;
  KILN_CHECK(is_text_type(*chunk_->type()), "data", "{}: column '{}' read as {}, not string", path_, text_key_,
             chunk_->type()->ToString());
}

bool TextColumnRows::next(Document& doc) {
  while (chunk_ && index_ < chunk_->length()) {
    const int64_t i = index_++;
    auto where = [&] { return fmt::format("{}:row {}", path_, first_row_ + i); };
    if (chunk_->IsNull(i)) {
      log_.report(BadInput::missing_text_key, where(), fmt::format("null in column '{}'", text_key_));
      continue;
    }
    const std::string_view text = value_at(*chunk_, i);
    if (text.empty()) {
      log_.report(BadInput::empty_document, where(), fmt::format("empty document (column '{}' is \"\")", text_key_));
      continue;
    }
    const size_t bad = find_invalid_utf8(text);
    if (bad != std::string_view::npos) {
      log_.report(BadInput::invalid_utf8, where(),
                  fmt::format("invalid UTF-8 (byte 0x{:02x} at byte {})", static_cast<unsigned char>(text[bad]), bad));
      continue;
    }
    doc.text.assign(text);
    return true;
  }
  return false;
}

}  // namespace kiln

#include "core/json_field.h"

#include "core/error.h"
#include "core/printable.h"

#include <cctype>
#include <cmath>

namespace kiln {

using nlohmann::json;

namespace {

constexpr size_t kShownBytes = 40;  // of a key or value quoted in an error

bool is_identifier(std::string_view key) {
  if (key.empty() || !(std::isalpha(static_cast<unsigned char>(key[0])) || key[0] == '_')) return false;
  for (const char c : key)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_')) return false;
  return true;
}

// A key as an error shows it: one line (control bytes escaped), long keys cut.
std::string shown_key(std::string_view key) { return printable(key, kShownBytes); }

// What a value is, for "must be X, got Y". Containers are never dumped: dump() recurses,
// and a hostile file nests arrays deeper than the stack.
std::string shown_value(const json& v) {
  if (v.is_object()) return "an object";
  if (v.is_array()) return "an array";
  if (v.is_null()) return "null";
  std::string text = v.dump(-1, ' ', false, json::error_handler_t::replace);
  if (text.size() > kShownBytes) text = text.substr(0, kShownBytes) + "...";
  return fmt::format("{} {}", v.type_name(), text);
}

}  // namespace

std::optional<int64_t> json_int64(const json& v) {
  if (!v.is_number_integer()) return std::nullopt;
  if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) return std::nullopt;
  return v.get<int64_t>();
}

JsonField::JsonField(const json& root, std::string_view where, std::string_view file)
    : value_(&root), where_(where), file_(file) {}

void JsonField::fail(std::string_view message) const {
  if (path_.empty()) kiln::fail(where_, "{}: {}", file_, message);
  kiln::fail(where_, "{}: {} {}", file_, path_, message);
}

void JsonField::fail_type(std::string_view expected) const {
  fail(fmt::format("must be {}, got {}", expected, shown_value(*value_)));
}

void JsonField::expect_object() const {
  if (!value_->is_object()) fail_type("an object");
}

JsonField JsonField::child(const json& value, std::string_view key, KeyKind kind) const {
  std::string path = path_;
  if (kind == KeyKind::field && is_identifier(key)) {
    if (!path.empty()) path += '.';
    path += key;
  } else {
    path += "['";
    path += shown_key(key);
    path += "']";
  }
  return JsonField(&value, where_, file_, std::move(path));
}

JsonField JsonField::member(std::string_view key) const {
  expect_object();
  const auto it = value_->find(key);
  if (it == value_->end()) {
    if (path_.empty()) fail(fmt::format("has no '{}'", shown_key(key)));
    fail(fmt::format("has no member '{}'", shown_key(key)));
  }
  return child(*it, key, KeyKind::field);
}

std::optional<JsonField> JsonField::find(std::string_view key) const {
  expect_object();
  const auto it = value_->find(key);
  if (it == value_->end() || it->is_null()) return std::nullopt;
  return child(*it, key, KeyKind::field);
}

size_t JsonField::array_size() const {
  if (!value_->is_array()) fail_type("an array");
  return value_->size();
}

JsonField JsonField::element(size_t index) const {
  if (index >= array_size()) fail(fmt::format("has no element {}", index));
  return JsonField(&(*value_)[index], where_, file_, fmt::format("{}[{}]", path_, index));
}

const std::string& JsonField::string() const {
  if (!value_->is_string()) fail_type("a string");
  return value_->get_ref<const std::string&>();
}

bool JsonField::boolean() const {
  if (!value_->is_boolean()) fail_type("true or false");
  return value_->get<bool>();
}

double JsonField::number() const {
  if (!value_->is_number()) fail_type("a number");
  const double v = value_->get<double>();
  if (!std::isfinite(v)) fail(fmt::format("= {} is not a finite number", v));
  return v;
}

int64_t JsonField::integer(int64_t min, int64_t max, std::string_view range) const {
  if (!value_->is_number_integer()) fail_type("an integer");
  const std::string bound = range.empty() ? fmt::format("[{}, {}]", min, max) : fmt::format("({})", range);
  // Unsigned values above INT64_MAX would wrap to negative in get<int64_t>().
  if (value_->is_number_unsigned() && value_->get<uint64_t>() > static_cast<uint64_t>(max))
    fail(fmt::format("= {} is out of range {}", value_->get<uint64_t>(), bound));
  const auto v = value_->get<int64_t>();
  if (v < min || v > max) fail(fmt::format("= {} is out of range {}", v, bound));
  return v;
}

uint64_t JsonField::unsigned_integer(uint64_t max) const {
  if (!value_->is_number_integer()) fail_type("a non-negative integer");
  if (!value_->is_number_unsigned()) fail(fmt::format("= {} is negative", value_->get<int64_t>()));
  const auto v = value_->get<uint64_t>();
  if (v > max) fail(fmt::format("= {} is out of range [0, {}]", v, max));
  return v;
}

std::string JsonField::string_or(std::string_view key, std::string fallback) const {
  const auto field = find(key);
  return field ? field->string() : std::move(fallback);
}

bool JsonField::boolean_or(std::string_view key, bool fallback) const {
  expect_object();
  if (!value_->contains(key)) return fallback;
  return member(key).boolean();
}

}  // namespace kiln

// Typed, range-checked reading of a JSON file, field by field, with one-line errors that
// name the file and the field:
//
//   [tokenizer] tok/tokenizer.json: added_tokens[3].id must be an integer, got string "7"
//   [tokenizer] tok/tokenizer.json: added_tokens[3].id = 2147483647 is out of range (...)
//
// nlohmann's own get<T>() throws type_error without the file's name, and converts numbers
// silently (2^32 + 3 read as an int32 is 3; 3.7 is 3), so parsers of files a user hands
// kiln read through JsonField instead.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace kiln {

// `v` as an int64 when it is a JSON integer that fits one, else nullopt. Where a number is
// not read through JsonField (request bodies, task files), this is how an integer is read:
// nlohmann keeps integers from 2^63 to 2^64 - 1 as unsigned, and get<int64_t>() wraps them
// to negatives (2^64 - 1 reads as -1); integers beyond those it parses as doubles.
std::optional<int64_t> json_int64(const nlohmann::json& v);

class JsonField {
 public:
  // The document's root. Errors read "[where] FILE: FIELD ..."; `where` and `file` must
  // outlive every field reached from this one.
  JsonField(const nlohmann::json& root, std::string_view where, std::string_view file);

  const nlohmann::json& value() const { return *value_; }
  // "model.vocab['Ġa']", "added_tokens[3].id"; "" for the root.
  const std::string& path() const { return path_; }
  bool is_null() const { return value_->is_null(); }
  bool is_string() const { return value_->is_string(); }
  bool is_array() const { return value_->is_array(); }
  bool is_object() const { return value_->is_object(); }

  // Object members. member() fails when this is not an object or has no `key`; find()
  // fails when this is not an object and is empty when `key` is absent or null.
  JsonField member(std::string_view key) const;
  std::optional<JsonField> find(std::string_view key) const;

  // Array elements (fails when this is not an array).
  size_t array_size() const;
  JsonField element(size_t index) const;

  // Calls fn(key, field) for each member of an object (fails when this is not one). The
  // keys are data (vocabulary tokens, tensor names), so errors quote them: vocab['a'].
  template <typename Fn>
  void for_each_member(Fn&& fn) const {
    expect_object();
    for (const auto& [key, value] : value_->items()) fn(key, child(value, key, KeyKind::data));
  }

  // The value as a type; fails naming the field when it is another type or out of range.
  const std::string& string() const;
  bool boolean() const;
  double number() const;  // any finite JSON number
  // An integer in [min, max]; `range` explains the bound in the error ("ids must be below
  // 259, ..."), "[min, max]" when empty.
  int64_t integer(int64_t min, int64_t max, std::string_view range = {}) const;
  uint64_t unsigned_integer(uint64_t max = UINT64_MAX) const;

  // Optional members: `fallback` when absent (or null for strings), else typed as above.
  std::string string_or(std::string_view key, std::string fallback) const;
  bool boolean_or(std::string_view key, bool fallback) const;

  // "[where] FILE: PATH MESSAGE" (or "[where] FILE: MESSAGE" at the root).
  [[noreturn]] void fail(std::string_view message) const;

 private:
  JsonField(const nlohmann::json* value, std::string_view where, std::string_view file, std::string path)
      : value_(value), where_(where), file_(file), path_(std::move(path)) {}
  // A named field reads .key in paths; a data key (or a key that is no identifier) ['key'].
  enum class KeyKind { field, data };
  JsonField child(const nlohmann::json& value, std::string_view key, KeyKind kind) const;
  void expect_object() const;
  [[noreturn]] void fail_type(std::string_view expected) const;

  const nlohmann::json* value_;
  std::string_view where_;
  std::string_view file_;
  std::string path_;
};

}  // namespace kiln

// Bad input: what the readers do with a malformed line, a truncated shard, a token out
// of range, ... Strict mode (the default) stops at the first one with a one-line error
// naming the file and line or byte offset:
//
//   [data] corpus.jsonl:17: malformed JSON (syntax error ...)
//   [data] train_000003.kiln:offset 4096: token 70000 >= vocab 65536
//
// Lenient mode (data.lenient = true) skips the unit that is bad (the line or document;
// the whole file for a bad header, a truncated file or a manifest mismatch) and counts
// it per reason; the counts are reported when reading ends and in the training log.
#pragma once

#include <array>
#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>

namespace kiln {

enum class BadInput : int {
  malformed_json,      // a JSONL line that does not parse, or is not an object
  invalid_utf8,        // document text that is not valid UTF-8
  missing_text_key,    // a JSONL object without a string field data.text_key; a null in a Parquet/Arrow text column
  empty_document,      // a document with no text (JSONL "") or no tokens
  truncated,           // a file shorter (or longer) than its header says; a cut compressed stream
  bad_header,          // wrong magic or version in a token file
  token_out_of_range,  // a token id >= the vocabulary size
  manifest_mismatch,   // a shard that does not match its manifest (counts, hash, tokenizer)
};
inline constexpr int kBadInputReasons = 8;

// "malformed JSON", "invalid UTF-8", ... (for messages and summaries).
std::string_view bad_input_name(BadInput reason);
// "malformed_json", ... (stable keys for JSON reports).
std::string_view bad_input_key(BadInput reason);

// Per-reason counts of skipped input; a plain value that is cheap to copy and merge.
struct BadInputCounts {
  std::array<int64_t, kBadInputReasons> counts{};

  int64_t operator[](BadInput r) const { return counts[static_cast<size_t>(r)]; }
  int64_t total() const;
  void merge(const BadInputCounts& other);
  // "2 malformed JSON, 1 invalid UTF-8" (reasons with a zero count are left out);
  // "none" when nothing was skipped.
  std::string summary() const;
};

// Where bad input is reported. Thread-safe: the readers of several files and the
// tokenizer workers may share one log.
class BadInputLog {
 public:
  explicit BadInputLog(bool lenient = false) : lenient_(lenient) {}

  bool lenient() const { return lenient_; }
  // Strict: throws kiln::Error("[data] WHERE: MESSAGE"). Lenient: counts `reason`,
  // remembers the first WHERE per reason, and returns so the caller skips the unit.
  void report(BadInput reason, std::string_view where, std::string_view message);

  BadInputCounts counts() const;
  // The location of the first skipped input for `reason` ("" when none).
  std::string first(BadInput reason) const;
  // counts().summary() with the first location of each reason:
  // "2 malformed JSON (first at a.jsonl:3), 1 empty document (first at a.jsonl:9)".
  std::string summary() const;
  // Adds counts gathered elsewhere (a worker's, a file scanned on its own).
  void merge(const BadInputCounts& counts);
  // Adds another log's counts, keeping this log's first locations where it has them.
  void merge(const BadInputLog& other);

 private:
  bool lenient_;
  mutable std::mutex mutex_;
  BadInputCounts counts_;
  std::array<std::string, kBadInputReasons> first_;
};

}  // namespace kiln

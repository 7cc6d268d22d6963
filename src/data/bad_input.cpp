#include "data/bad_input.h"

#include "core/error.h"

#include <fmt/format.h>

namespace kiln {

namespace {

struct ReasonNames {
  std::string_view name;
  std::string_view key;
};

constexpr std::array<ReasonNames, kBadInputReasons> kNames = {{
    {"malformed JSON", "malformed_json"},
    {"invalid UTF-8", "invalid_utf8"},
    {"missing text key", "missing_text_key"},
    {"empty document", "empty_document"},
    {"truncated file", "truncated"},
    {"wrong magic or version", "bad_header"},
    {"token out of range", "token_out_of_range"},
    {"manifest mismatch", "manifest_mismatch"},
}};

}  // namespace

std::string_view bad_input_name(BadInput reason) { return kNames[static_cast<size_t>(reason)].name; }
std::string_view bad_input_key(BadInput reason) { return kNames[static_cast<size_t>(reason)].key; }

int64_t BadInputCounts::total() const {
  int64_t sum = 0;
  for (const int64_t c : counts) sum += c;
  return sum;
}

void BadInputCounts::merge(const BadInputCounts& other) {
  for (size_t i = 0; i < counts.size(); ++i) counts[i] += other.counts[i];
}

std::string BadInputCounts::summary() const {
  std::string out;
  for (size_t i = 0; i < counts.size(); ++i) {
    if (counts[i] == 0) continue;
    if (!out.empty()) out += ", ";
    out += fmt::format("{} {}", counts[i], kNames[i].name);
  }
  return out.empty() ? "none" : out;
}

void BadInputLog::report(BadInput reason, std::string_view where, std::string_view message) {
  if (!lenient_) fail("data", "{}: {}", where, message);
  const std::lock_guard lock(mutex_);
  const auto i = static_cast<size_t>(reason);
  if (counts_.counts[i]++ == 0) first_[i] = std::string(where);
}

BadInputCounts BadInputLog::counts() const {
  const std::lock_guard lock(mutex_);
  return counts_;
}

std::string BadInputLog::first(BadInput reason) const {
  const std::lock_guard lock(mutex_);
  return first_[static_cast<size_t>(reason)];
}

std::string BadInputLog::summary() const {
  const std::lock_guard lock(mutex_);
  std::string out;
  for (size_t i = 0; i < counts_.counts.size(); ++i) {
    if (counts_.counts[i] == 0) continue;
    if (!out.empty()) out += ", ";
    out += fmt::format("{} {}", counts_.counts[i], kNames[i].name);
    if (!first_[i].empty()) out += fmt::format(" (first at {})", first_[i]);
  }
  return out.empty() ? "none" : out;
}

void BadInputLog::merge(const BadInputLog& other) {
  if (&other == this) return;
  const BadInputCounts counts = other.counts();
  std::array<std::string, kBadInputReasons> firsts;
  for (size_t i = 0; i < firsts.size(); ++i) firsts[i] = other.first(static_cast<BadInput>(i));
  const std::lock_guard lock(mutex_);
  for (size_t i = 0; i < firsts.size(); ++i) {
    if (counts_.counts[i] == 0 && counts.counts[i] > 0) first_[i] = firsts[i];
  }
  counts_.merge(counts);
}

void BadInputLog::merge(const BadInputCounts& counts) {
  const std::lock_guard lock(mutex_);
  counts_.merge(counts);
}

}  // namespace kiln

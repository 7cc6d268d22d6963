#include "data/bpe/added_tokens.h"

#include "data/bpe/byte_unicode.h"

#include <utf8proc.h>

#include <algorithm>

namespace kiln::bpe {
namespace {

// Rust's char::is_whitespace / regex \s: the Unicode White_Space property.
bool is_white_space(int32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

// regex \w: alphabetic, marks, decimal digits, connector punctuation, joiners.
bool is_word_char(int32_t c) {
  if (c < 0) return false;
  if (c == 0x200C || c == 0x200D) return true;
  switch (utf8proc_category(c)) {
    case UTF8PROC_CATEGORY_LU: case UTF8PROC_CATEGORY_LL: case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM: case UTF8PROC_CATEGORY_LO: case UTF8PROC_CATEGORY_MN:
    case UTF8PROC_CATEGORY_MC: case UTF8PROC_CATEGORY_ME: case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL: case UTF8PROC_CATEGORY_PC:
      return true;
    default:
      return false;
  }
}

// Start of the code point that ends just before position i (i > 0).
size_t previous_start(std::string_view s, size_t i) {
  size_t j = i - 1;
  while (j > 0 && i - j < 4 && (static_cast<uint8_t>(s[j]) & 0xC0) == 0x80) --j;
  return j;
}

int32_t codepoint_before(std::string_view s, size_t i) {
  size_t j = previous_start(s, i);
  const int32_t c = next_codepoint(s, j);
  return j == i ? c : -1;
}

}  // namespace

AddedTokenMatcher::AddedTokenMatcher(const std::vector<const AddedToken*>& tokens,
                                     const std::vector<std::string>& patterns) {
  if (tokens.empty()) return;
  nodes_.emplace_back();
  for (size_t t = 0; t < tokens.size(); ++t) {
    const std::string& p = patterns[t];
    if (p.empty()) continue;
    first_byte_[static_cast<uint8_t>(p[0])] = true;
    int32_t node = 0;
    for (const char ch : p) {
      const auto byte = static_cast<uint8_t>(ch);
      int32_t next = child(node, byte);
      if (next < 0) {
        next = static_cast<int32_t>(nodes_.size());
        nodes_.emplace_back();
        auto& edges = nodes_[static_cast<size_t>(node)].next;
        edges.insert(std::lower_bound(edges.begin(), edges.end(), std::make_pair(byte, int32_t{0})),
                     {byte, next});
      }
      node = next;
    }
    // The same content twice: the first token listed wins (ids are equal in practice).
    if (!nodes_[static_cast<size_t>(node)].token) nodes_[static_cast<size_t>(node)].token = tokens[t];
  }
}

int32_t AddedTokenMatcher::child(int32_t node, uint8_t byte) const {
  const auto& edges = nodes_[static_cast<size_t>(node)].next;
  const auto it = std::lower_bound(edges.begin(), edges.end(), std::make_pair(byte, int32_t{0}));
  return it != edges.end() && it->first == byte ? it->second : -1;
}

void AddedTokenMatcher::find_all(std::string_view text, std::vector<Match>& out) const {
  if (nodes_.empty()) return;
  size_t consumed = 0;  // end of the previous match (lstrip never reaches before it)
  size_t pos = 0;
  while (pos < text.size()) {
    if (!first_byte_[static_cast<uint8_t>(text[pos])]) {
      ++pos;
      continue;
    }
    // Longest token starting at pos.
    const AddedToken* best = nullptr;
    size_t best_end = 0;
    int32_t node = 0;
    for (size_t i = pos; i < text.size(); ++i) {
      node = child(node, static_cast<uint8_t>(text[i]));
      if (node < 0) break;
      if (nodes_[static_cast<size_t>(node)].token) {
        best = nodes_[static_cast<size_t>(node)].token;
        best_end = i + 1;
      }
    }
    if (!best) {
      ++pos;
      continue;
    }
    size_t begin = pos, end = best_end;
    pos = best_end;  // matches never overlap, even when this one is discarded
    if (best->single_word) {
      const bool left_ok = begin == 0 || !is_word_char(codepoint_before(text, begin));
      size_t j = end;
      const bool right_ok = end == text.size() || !is_word_char(next_codepoint(text, j));
      if (!left_ok || !right_ok) continue;
    }
    if (best->lstrip) {
      size_t b = begin;
      while (b > consumed && is_white_space(codepoint_before(text, b))) b = previous_start(text, b);
      begin = b;
    }
    if (best->rstrip) {
      size_t e = end;
      while (e < text.size()) {
        size_t j = e;
        if (!is_white_space(next_codepoint(text, j))) break;
        e = j;
      }
      end = e;
      pos = std::max(pos, end);
    }
    out.push_back({begin, end, best});
    consumed = end;
  }
}

}  // namespace kiln::bpe

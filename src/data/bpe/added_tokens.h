// Added tokens (special tokens like <|endoftext|>, and user-added ones): found in the
// text before any normalization or pre-tokenization and never merged with neighbours.
//
// Matching follows Hugging Face `tokenizers`: leftmost-longest over all contents, then
// per-token options: single_word (skip a match touching a word character), lstrip /
// rstrip (the token swallows adjacent whitespace).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace kiln::bpe {

struct AddedToken {
  int32_t id = -1;
  std::string content;
  bool special = false;
  bool single_word = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = false;
};

class AddedTokenMatcher {
 public:
  struct Match {
    size_t begin = 0;
    size_t end = 0;
    const AddedToken* token = nullptr;
  };

  AddedTokenMatcher() = default;
  // `patterns[i]` is what is searched for tokens[i] (its content, normalized or not).
  // The tokens must outlive the matcher.
  AddedTokenMatcher(const std::vector<const AddedToken*>& tokens, const std::vector<std::string>& patterns);
  bool empty() const { return nodes_.empty(); }

  // Appends the matches in `text`, left to right, non-overlapping.
  void find_all(std::string_view text, std::vector<Match>& out) const;

 private:
  struct Node {
    std::vector<std::pair<uint8_t, int32_t>> next;  // sorted by byte
    const AddedToken* token = nullptr;
  };
  int32_t child(int32_t node, uint8_t byte) const;
  bool first_byte_[256] = {};
  std::vector<Node> nodes_;
};

}  // namespace kiln::bpe

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

  // Encodes `text` around the matches: encode(stretch) for each stretch before, between
  // and after them (empty ones too), each match's token id appended to ids in its place.
  template <typename Encode>
  void encode_around(std::string_view text, std::vector<int32_t>& ids, Encode&& encode) const {
    if (empty()) return encode(text);
    std::vector<Match> matches;
    find_all(text, matches);
    size_t last = 0;
    for (const Match& m : matches) {
      encode(text.substr(last, m.begin - last));
      ids.push_back(m.token->id);
      last = m.end;
    }
    encode(text.substr(last));
  }

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

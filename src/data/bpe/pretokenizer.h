// Pre-tokenization: how text is cut into pieces ("pretokens") before BPE merges run
// inside each piece. Mirrors the Hugging Face `tokenizers` pre_tokenizer steps that
// byte-level BPE files use: Split (regex or literal, behavior Isolated or Removed) and
// ByteLevel (optional prefix space, optional GPT-2 regex split), chained as a Sequence.
//
// Regexes run on PCRE2 with UTF + UCP and the JIT. tokenizer.json patterns are written
// for Oniguruma; for the byte-level patterns (\p{L}, \p{N}, \s, (?i:...), (?!\S)) the two
// agree, U+0085 (NEL) in \s included (tests/test_bpe*.cpp check this against
// `tokenizers`). Invalid UTF-8 in the input never matches (PCRE2_MATCH_INVALID_UTF), so
// such bytes become pieces of their own and still encode byte by byte.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace kiln::bpe {

// The split patterns of well-known tokenizers: "gpt2", "llama3", "qwen2" (empty view
// for any other name).
std::string_view named_pattern(std::string_view name);

class Regex {
 public:
  // `pattern` is in tokenizer.json's (Oniguruma) dialect; `literal` matches it verbatim.
  // Throws kiln::Error("[tokenizer] ORIGIN: bad regex ...") when it does not compile.
  Regex(std::string_view pattern, bool literal, std::string_view origin);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Finds the first non-empty match at or after `start`; false when there is none.
  bool find(std::string_view text, size_t start, size_t& begin, size_t& end) const;
  const std::string& pattern() const { return pattern_; }

 private:
  std::string pattern_;
  void* code_ = nullptr;  // pcre2_code_8
  bool jit_ = false;
};

enum class SplitBehavior { isolated, removed };

class PreTokenizer {
 public:
  void add_split(std::shared_ptr<const Regex> regex, SplitBehavior behavior);
  // use_regex: split with the GPT-2 pattern first (ByteLevel's own regex).
  void add_byte_level(bool add_prefix_space, bool use_regex);
  bool has_byte_level() const { return has_byte_level_; }
  bool empty() const { return steps_.empty(); }

  // Calls emit(piece) for each non-empty pretoken of `text`, in order. A piece can point
  // into temporary storage (a prefix space), so emit must not keep the view.
  template <typename Emit>
  void run(std::string_view text, Emit&& emit) const {
    run_from(0, text, emit);
  }

 private:
  struct Step {
    std::shared_ptr<const Regex> regex;  // null: no split in this step
    SplitBehavior behavior = SplitBehavior::isolated;
    bool prefix_space = false;
  };

  template <typename Emit>
  void run_from(size_t step, std::string_view text, Emit& emit) const {
    if (text.empty()) return;
    if (step == steps_.size()) {
      emit(text);
      return;
    }
    const Step& s = steps_[step];
    if (s.prefix_space && text.front() != ' ') {
      std::string spaced;
      spaced.reserve(text.size() + 1);
      spaced.push_back(' ');
      spaced.append(text);
      split(step, s, spaced, emit);
    } else {
      split(step, s, text, emit);
    }
  }

  template <typename Emit>
  void split(size_t step, const Step& s, std::string_view text, Emit& emit) const {
    if (!s.regex) {
      run_from(step + 1, text, emit);
      return;
    }
    size_t last = 0, begin = 0, end = 0;
    while (last < text.size() && s.regex->find(text, last, begin, end)) {
      if (begin > last) run_from(step + 1, text.substr(last, begin - last), emit);
      if (s.behavior == SplitBehavior::isolated) run_from(step + 1, text.substr(begin, end - begin), emit);
      last = end;
    }
    if (last < text.size()) run_from(step + 1, text.substr(last), emit);
  }

  std::vector<Step> steps_;
  bool has_byte_level_ = false;
};

}  // namespace kiln::bpe

#include "data/bpe/pretokenizer.h"

#include "core/error.h"
#include "core/printable.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

namespace kiln::bpe {
namespace {

constexpr std::string_view kGpt2 = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
constexpr std::string_view kLlama3 =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr std::string_view kQwen2 =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// Per-thread PCRE2 state: match data (one pair is all we read) and a JIT stack large
// enough for long whitespace or letter runs.
struct ThreadState {
  pcre2_match_data* data = pcre2_match_data_create(1, nullptr);
  pcre2_match_context* context = pcre2_match_context_create(nullptr);
  pcre2_jit_stack* stack = pcre2_jit_stack_create(32 * 1024, 4 * 1024 * 1024, nullptr);
  ThreadState() { pcre2_jit_stack_assign(context, nullptr, stack); }
  ~ThreadState() {
    pcre2_jit_stack_free(stack);
    pcre2_match_context_free(context);
    pcre2_match_data_free(data);
  }
};

ThreadState& thread_state() {
  thread_local ThreadState state;
  return state;
}

}  // namespace

std::string_view named_pattern(std::string_view name) {
  if (name == "gpt2") return kGpt2;
  if (name == "llama3") return kLlama3;
  if (name == "qwen2") return kQwen2;
  return {};
}

Regex::Regex(std::string_view pattern, bool literal, std::string_view origin) : pattern_(pattern) {
  uint32_t options = PCRE2_UTF | PCRE2_MATCH_INVALID_UTF;
  options |= literal ? PCRE2_LITERAL : PCRE2_UCP;
  int error = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), options,
                                   &error, &offset, nullptr);
  if (!code) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error, message, sizeof(message));
    fail("tokenizer", "{}{}bad regex '{}' at offset {}: {}", origin, origin.empty() ? "" : ": ", printable(pattern), offset,
         reinterpret_cast<const char*>(message));
  }
  jit_ = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
  code_ = code;
}

Regex::~Regex() { pcre2_code_free(static_cast<pcre2_code*>(code_)); }

bool Regex::find(std::string_view text, size_t start, size_t& begin, size_t& end) const {
  ThreadState& t = thread_state();
  auto* code = static_cast<pcre2_code*>(code_);
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  while (start < text.size()) {
    const int rc = jit_ ? pcre2_jit_match(code, subject, text.size(), start, 0, t.data, t.context)
                        : pcre2_match(code, subject, text.size(), start, 0, t.data, t.context);
    if (rc == PCRE2_ERROR_NOMATCH) return false;
    if (rc < 0) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(rc, message, sizeof(message));
      fail("tokenizer", "regex '{}' failed: {}", printable(pattern_), reinterpret_cast<const char*>(message));
    }
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(t.data);
    if (ovector[1] > ovector[0]) {
      begin = ovector[0];
      end = ovector[1];
      return true;
    }
    // An empty match produces no piece: retry from the next character.
    start = ovector[0] + 1;
    while (start < text.size() && (static_cast<unsigned char>(text[start]) & 0xC0) == 0x80) ++start;
  }
  return false;
}

void PreTokenizer::add_split(std::shared_ptr<const Regex> regex, SplitBehavior behavior) {
  steps_.push_back({std::move(regex), behavior, false});
}

void PreTokenizer::add_byte_level(bool add_prefix_space, bool use_regex) {
  Step step;
  step.prefix_space = add_prefix_space;
  if (use_regex) step.regex = std::make_shared<Regex>(kGpt2, false, "");
  // The byte -> Unicode mapping itself is the identity here: kiln's vocabulary is in bytes.
  if (step.regex || step.prefix_space) steps_.push_back(std::move(step));
  has_byte_level_ = true;
}

}  // namespace kiln::bpe

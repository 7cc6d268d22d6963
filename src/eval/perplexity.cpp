#include "eval/perplexity.h"

#include "core/error.h"
#include "infer/decoder.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace kiln::eval {

std::vector<Continuation> rolling_windows(const std::vector<int32_t>& tokens, int32_t prefix, int64_t window) {
  KILN_CHECK(window >= 1, "eval", "a rolling window must hold at least one token, got {}", window);
  std::vector<Continuation> windows;
  const auto n = static_cast<int64_t>(tokens.size());
  if (n == 0) return windows;
  auto at = [&](int64_t i) { return tokens.begin() + static_cast<std::ptrdiff_t>(i); };
  // The first window: the prefix predicts the first token, and so on.
  const int64_t first = std::min(window, n);
  windows.push_back({{prefix}, {at(0), at(first)}});
  // Each later window predicts the next `window` tokens (fewer at the end); its input is the
  // `window` tokens before its last, so the context is what of them is not predicted.
  for (int64_t predicted = first; predicted < n;) {
    const int64_t count = std::min(n - predicted, window);
    const int64_t end = predicted + count;
    const int64_t input_begin = std::max<int64_t>(0, end - window - 1);
    windows.push_back({{at(input_begin), at(predicted)}, {at(predicted), at(end)}});
    predicted = end;
  }
  return windows;
}

int64_t count_words(const std::string& text) {
  auto space = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; };
  int64_t pieces = 1;
  for (size_t i = 0; i < text.size(); ++i)
    if (space(text[i]) && (i == 0 || !space(text[i - 1]))) ++pieces;
  return pieces;
}

PerplexityResult evaluate_perplexity(Generator& generator, const Tokenizer& tokenizer, const std::string& name,
                                     const std::vector<std::string>& documents, const ScoringOptions& options) {
  const int64_t window = scoring_length(generator, options) - 1;
  KILN_CHECK(window >= 1, "eval", "{}: a context of {} tokens is too short to score text", name, window + 1);
  PerplexityResult r;
  r.name = name;
  std::vector<Continuation> requests;
  for (const std::string& text : documents) {
    const std::vector<int32_t> tokens = tokenizer.encode(text);
    if (tokens.empty()) continue;
    std::vector<Continuation> windows = rolling_windows(tokens, tokenizer.bos_id(), window);
    requests.insert(requests.end(), std::make_move_iterator(windows.begin()), std::make_move_iterator(windows.end()));
    r.documents += 1;
    r.tokens += static_cast<int64_t>(tokens.size());
    r.words += count_words(text);
    r.bytes += static_cast<int64_t>(text.size());
  }
  KILN_CHECK(r.tokens > 0, "eval", "{}: no text to score", name);
  for (const ContinuationScore& s : score_continuations(generator, requests, options)) r.logprob += s.logprob;
  r.token_perplexity = std::exp(-r.logprob / static_cast<double>(r.tokens));
  r.word_perplexity = std::exp(-r.logprob / static_cast<double>(r.words));
  r.byte_perplexity = std::exp(-r.logprob / static_cast<double>(r.bytes));
  r.bits_per_byte = -r.logprob / static_cast<double>(r.bytes) / std::numbers::ln2;
  return r;
}

}  // namespace kiln::eval

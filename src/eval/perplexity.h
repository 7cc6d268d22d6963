// Perplexity of text, as lm-evaluation-harness computes it for its `loglikelihood_rolling`
// tasks (wikitext): each document is cut into windows that together predict every one of
// its tokens exactly once, the first from BOS alone, each later one from the tokens before
// it (a full window of context for the last, shorter window; one token for the others:
// lm-eval's rolling windows with context_len 1). The sums over all documents give
//   token_perplexity = exp(-logprob / tokens)
//   word_perplexity  = exp(-logprob / words)     words: lm-eval's len(re.split(r"\s+", doc))
//   byte_perplexity  = exp(-logprob / bytes)     bytes: of the UTF-8 text
//   bits_per_byte    = -logprob / bytes / ln 2
// The word and byte measures do not depend on the tokenizer, so they compare models with
// different vocabularies.
#pragma once

#include "eval/loglikelihood.h"

#include <cstdint>
#include <string>
#include <vector>

namespace kiln::eval {

struct PerplexityResult {
  std::string name;
  int64_t documents = 0, tokens = 0, words = 0, bytes = 0;
  double logprob = 0;  // nats, summed over every token of every document
  double token_perplexity = 0, word_perplexity = 0, byte_perplexity = 0, bits_per_byte = 0;
};

// lm-eval's rolling windows of `tokens`, each a scoring request: the windows predict up to
// `window` tokens each; the first is conditioned on `prefix` alone.
std::vector<Continuation> rolling_windows(const std::vector<int32_t>& tokens, int32_t prefix, int64_t window);

// lm-eval's word count: the pieces of re.split(r"\s+", text) (ASCII whitespace here), so
// leading or trailing whitespace adds an empty piece, as there.
int64_t count_words(const std::string& text);

// Windows of scoring_length() less one token (the prefix or context token before them). A
// document with no token is skipped (and not counted).
PerplexityResult evaluate_perplexity(Generator& generator, const Tokenizer& tokenizer, const std::string& name,
                                     const std::vector<std::string>& documents, const ScoringOptions& options = {});

}  // namespace kiln::eval

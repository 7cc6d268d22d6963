// Log-likelihood scoring: how likely the model finds a continuation after a context, the
// primitive every evaluation here is built on (multiple choice, perplexity). It is what
// lm-evaluation-harness asks of a model (its `loglikelihood` requests), computed the way
// that harness computes it, so `kiln eval` and lm-eval through `kiln serve` agree:
//   - the pair is tokenized whole and the context alone; the continuation is the whole
//     encoding past the context's tokens (a token spanning the border goes to the
//     continuation), after moving the context's trailing whitespace to the continuation;
//   - a context + continuation longer than the model's context loses tokens on the left.
// Scoring runs through the KV-cache decoder and the Generator (the path of `kiln serve`),
// so it is batched over the decoder's slots on the CPU or the GPU.
#pragma once

#include "data/tokenizer.h"
#include "infer/generator.h"

#include <cstdint>
#include <functional>
#include <stdexcept>
#include <span>
#include <string_view>
#include <vector>

namespace kiln::eval {

// Token ids of one scoring request: the continuation's tokens are scored given all before.
struct Continuation {
  std::vector<int32_t> context;       // at least one token (BOS, when the text has none)
  std::vector<int32_t> continuation;  // at least one token
};

struct ContinuationScore {
  double logprob = 0;    // sum of log p(token | everything before) over the continuation (nats)
  int64_t tokens = 0;    // continuation tokens scored
  bool greedy = true;    // every continuation token is the model's most likely next token
  bool truncated = false;  // context tokens were dropped on the left to fit
};

// lm-eval's encoding of a (context, continuation) pair, with BOS first when `bos` (kiln's
// documents start with BOS in training). An empty context is BOS alone either way (lm-eval
// puts its prefix token there). Whitespace moved is ASCII's (Python's rstrip() also moves
// Unicode spaces; a context ending in one differs).
Continuation encode_pair(const Tokenizer& tokenizer, std::string_view context, std::string_view continuation,
                         bool bos);

// Thrown when the `stop` callback of an evaluation asked it to end (a training run's stop
// signal): an evaluation cut short has no result.
struct EvalStopped : std::runtime_error {
  EvalStopped() : std::runtime_error("evaluation stopped") {}
};

struct ScoringOptions {
  // Tokens of context + continuation a request keeps (its last ones; lm-eval's max_length);
  // 0 = the decoder's context (max_len). At most max_len.
  int64_t max_length = 0;
  std::function<bool()> stop;  // polled between decoder steps; true ends it with EvalStopped
};

// The tokens a request keeps: options.max_length, or the decoder's context.
int64_t scoring_length(const Generator& generator, const ScoringOptions& options);

// Scores every request, batched over the generator's decoder slots; results in order. A
// request longer than scoring_length() keeps its last tokens (the context's are dropped);
// a continuation that alone does not fit (with one context token) is an error naming it.
std::vector<ContinuationScore> score_continuations(Generator& generator, std::span<const Continuation> requests,
                                                   const ScoringOptions& options = {});

}  // namespace kiln::eval

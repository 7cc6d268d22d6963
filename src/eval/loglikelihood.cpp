#include "eval/loglikelihood.h"

#include "core/error.h"
#include "infer/decoder.h"

#include <algorithm>

namespace kiln::eval {

Continuation encode_pair(const Tokenizer& tokenizer, std::string_view context, std::string_view continuation,
                         bool bos) {
  // Trailing whitespace belongs to the continuation: " Paris" is one token in most
  // vocabularies, and the context "... is " + "Paris" would otherwise split it.
  size_t kept = context.size();
  while (kept > 0 && (context[kept - 1] == ' ' || context[kept - 1] == '\t' || context[kept - 1] == '\n' ||
                      context[kept - 1] == '\r' || context[kept - 1] == '\f' || context[kept - 1] == '\v'))
    --kept;
  const std::string moved = std::string(context.substr(kept)) + std::string(continuation);
  context = context.substr(0, kept);

  Continuation c;
  if (bos || context.empty()) c.context.push_back(tokenizer.bos_id());  // something predicts the first token
  if (context.empty()) {
    c.continuation = tokenizer.encode(moved);
    return c;
  }
  const std::vector<int32_t> whole = tokenizer.encode(std::string(context) + moved);
  const std::vector<int32_t> head = tokenizer.encode(context);
  c.context.insert(c.context.end(), head.begin(), head.end());
  if (whole.size() > head.size()) c.continuation.assign(whole.begin() + static_cast<std::ptrdiff_t>(head.size()), whole.end());
  return c;
}

int64_t scoring_length(const Generator& generator, const ScoringOptions& options) {
  const int64_t context = generator.decoder().max_len();
  KILN_CHECK(options.max_length >= 0 && options.max_length <= context, "eval",
             "a max length of {} tokens; the model's context holds {}", options.max_length, context);
  return options.max_length > 0 ? options.max_length : context;
}

std::vector<ContinuationScore> score_continuations(Generator& generator, std::span<const Continuation> requests,
                                                   const ScoringOptions& options) {
  const int64_t max_len = scoring_length(generator, options);
  std::vector<ContinuationScore> scores(requests.size());
  std::vector<GenerationRequest> batch;
  batch.reserve(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    const Continuation& r = requests[i];
    const auto context = static_cast<int64_t>(r.context.size());
    const auto continuation = static_cast<int64_t>(r.continuation.size());
    KILN_CHECK(context >= 1, "eval", "request {}: the context has no token", i);
    KILN_CHECK(continuation >= 1, "eval", "request {}: the continuation has no token", i);
    KILN_CHECK(continuation < max_len, "eval",
               "request {}: the continuation alone has {} tokens; {} fit (one more is needed to predict the "
               "first)",
               i, continuation, max_len);
    // As lm-eval: the last max_len tokens of context + continuation.
    const int64_t dropped = std::max<int64_t>(0, context + continuation - max_len);
    GenerationRequest g;
    g.prompt.assign(r.context.begin() + dropped, r.context.end());
    g.prompt.insert(g.prompt.end(), r.continuation.begin(), r.continuation.end());
    g.max_tokens = 0;
    g.prompt_logprobs = true;
    g.prompt_logprobs_from = context - dropped;
    g.top_logprobs = 1;  // the most likely token at each position: is the continuation greedy?
    scores[i].truncated = dropped > 0;
    scores[i].tokens = continuation;
    batch.push_back(std::move(g));
  }
  std::vector<GenerationResult> results(requests.size());
  try {
    for (size_t i = 0; i < batch.size(); ++i)
      generator.submit(std::move(batch[i]), [&results, i](GenerationResult&& done) { results[i] = std::move(done); });
    while (generator.step())
      if (options.stop && options.stop()) throw EvalStopped();
  } catch (...) {
    generator.abort("evaluation ended");  // nothing queued may outlive `results`
    throw;
  }
  for (size_t i = 0; i < results.size(); ++i) {
    const GenerationResult& g = results[i];
    KILN_CHECK(g.error.empty(), "eval", "request {}: {}", i, g.error);
    ContinuationScore& s = scores[i];
    const size_t first = g.prompt_logprobs.size() - static_cast<size_t>(s.tokens);
    for (size_t t = first; t < g.prompt_logprobs.size(); ++t) {
      const TokenLogprob& p = g.prompt_logprobs[t];
      s.logprob += p.logprob;
      // Ties count as greedy: the token is among the most likely.
      if (!p.top.empty() && p.logprob < p.top.front().second) s.greedy = false;
    }
  }
  return scores;
}

}  // namespace kiln::eval

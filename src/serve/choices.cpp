// Several choices of one prompt (n, best_of): which sequences answer, and how usage counts
// the prompt they share (serve/completion_api.h).
#include "serve/completion_api.h"

#include <algorithm>
#include <numeric>

namespace kiln::serve {

double mean_logprob(const GenerationResult& result) {
  double sum = 0;
  size_t count = 0;
  for (const TokenLogprob& lp : result.logprobs) sum += lp.logprob, ++count;
  // The EOS that ended it was drawn too: a sequence that stops where the model is sure it
  // should is not ranked below one that runs on.
  if (result.eos_logprob) sum += result.eos_logprob->logprob, ++count;
  return count == 0 ? 0.0 : sum / static_cast<double>(count);
}

std::vector<size_t> answer_sequences(const CompletionRequest& request, const std::vector<GenerationResult>& results) {
  std::vector<size_t> chosen(results.size());
  std::iota(chosen.begin(), chosen.end(), size_t{0});
  if (request.best_of <= request.n) return chosen;
  const auto group = static_cast<size_t>(request.best_of), keep = static_cast<size_t>(request.n);
  std::vector<size_t> out;
  for (size_t first = 0; first + group <= results.size(); first += group) {
    std::vector<size_t> order(chosen.begin() + static_cast<std::ptrdiff_t>(first),
                              chosen.begin() + static_cast<std::ptrdiff_t>(first + group));
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t a, size_t b) { return mean_logprob(results[a]) > mean_logprob(results[b]); });
    out.insert(out.end(), order.begin(), order.begin() + static_cast<std::ptrdiff_t>(keep));
  }
  return out;
}

int64_t prompt_tokens(const std::vector<GenerationRequest>& sequences) {
  int64_t total = 0;
  for (const GenerationRequest& g : sequences)
    if (!g.shares_prefill) total += static_cast<int64_t>(g.prompt.size());
  return total;
}

}  // namespace kiln::serve

#include "infer/sampler.h"

#include "core/rng.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace kiln {

namespace {

int32_t pick(std::vector<float>& logits, const SampleOptions& o, Rng& rng, std::vector<int32_t>& order) {
  const int32_t vocab = static_cast<int32_t>(logits.size());
  if (o.temperature <= 0) return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  order.resize(static_cast<size_t>(vocab));
  std::iota(order.begin(), order.end(), 0);
  const int32_t k = o.top_k > 0 ? static_cast<int32_t>(std::min<int64_t>(o.top_k, vocab)) : vocab;
  std::partial_sort(order.begin(), order.begin() + k, order.end(),
                    [&](int32_t a, int32_t b) { return logits[static_cast<size_t>(a)] > logits[static_cast<size_t>(b)]; });
  const double top = logits[static_cast<size_t>(order[0])];
  double total = 0;
  std::vector<double> weights(static_cast<size_t>(k));
  for (int32_t i = 0; i < k; ++i) {
    weights[static_cast<size_t>(i)] = std::exp((logits[static_cast<size_t>(order[static_cast<size_t>(i)])] - top) / o.temperature);
    total += weights[static_cast<size_t>(i)];
  }
  double u = rng.uniform() * total;
  for (int32_t i = 0; i < k; ++i) {
    u -= weights[static_cast<size_t>(i)];
    if (u <= 0) return order[static_cast<size_t>(i)];
  }
  return order[static_cast<size_t>(k - 1)];
}

}  // namespace

std::string generate(Model& model, const Tokenizer& tokenizer, const std::string& prompt,
                     const SampleOptions& options) {
  const int64_t context = std::min(model.config().max_seq_len, model.options().max_tokens);
  std::vector<int32_t> tokens{tokenizer.bos_id()};
  for (int32_t id : tokenizer.encode(prompt)) tokens.push_back(id);
  std::vector<int32_t> generated;
  Rng rng(options.seed);
  HostBatch batch;
  std::vector<float> logits;
  std::vector<int32_t> order;
  for (int64_t step = 0; step < options.max_tokens; ++step) {
    // The most recent `context` tokens, as one sequence at positions 0..n-1.
    const int64_t n = std::min<int64_t>(static_cast<int64_t>(tokens.size()), context);
    batch.tokens.assign(tokens.end() - n, tokens.end());
    batch.targets.assign(static_cast<size_t>(n), kIgnoreTarget);
    batch.positions.resize(static_cast<size_t>(n));
    std::iota(batch.positions.begin(), batch.positions.end(), 0);
    batch.cu_seqlens = {0, static_cast<int32_t>(n)};
    batch.max_seqlen = static_cast<int32_t>(n);
    model.load_batch(batch);
    model.logits(n - 1, 1, logits);
    const int32_t next = pick(logits, options, rng, order);
    if (options.stop_at_eos && next == tokenizer.eos_id()) break;
    tokens.push_back(next);
    generated.push_back(next);
  }
  return tokenizer.decode(generated);
}

}  // namespace kiln

#include "infer/sampling.h"

#include "core/error.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace kiln {

void SamplingParams::validate() const {
  KILN_CHECK(std::isfinite(temperature) && temperature >= 0, "sampling", "temperature must be >= 0, got {}",
             temperature);
  KILN_CHECK(top_k >= 0, "sampling", "top_k must be >= 0, got {}", top_k);
  KILN_CHECK(top_p > 0 && top_p <= 1, "sampling", "top_p must be in (0, 1], got {}", top_p);
  KILN_CHECK(min_p >= 0 && min_p <= 1, "sampling", "min_p must be in [0, 1], got {}", min_p);
  KILN_CHECK(std::isfinite(repetition_penalty) && repetition_penalty > 0, "sampling",
             "repetition_penalty must be > 0, got {}", repetition_penalty);
  KILN_CHECK(std::isfinite(presence_penalty) && std::abs(presence_penalty) <= 2, "sampling",
             "presence_penalty must be in [-2, 2], got {}", presence_penalty);
  KILN_CHECK(std::isfinite(frequency_penalty) && std::abs(frequency_penalty) <= 2, "sampling",
             "frequency_penalty must be in [-2, 2], got {}", frequency_penalty);
  for (const auto& [id, bias] : logit_bias)
    KILN_CHECK(id >= 0 && std::isfinite(bias) && std::abs(bias) <= 100, "sampling",
               "logit_bias must map token ids >= 0 to biases in [-100, 100], got {} -> {}", id, bias);
}

bool SamplingParams::changes_logits() const {
  return repetition_penalty != 1.0 || presence_penalty != 0 || frequency_penalty != 0 || !logit_bias.empty();
}

int32_t Sampler::sample(std::span<float> logits, std::span<const int32_t> context, const SamplingParams& p, Rng& rng,
                        size_t prompt_length) {
  const auto vocab = static_cast<int32_t>(logits.size());
  for (const auto& [id, bias] : p.logit_bias)
    if (id < vocab) logits[static_cast<size_t>(id)] += bias;  // ids past the row: a padded vocabulary's, never drawn
  if (p.repetition_penalty != 1.0) {
    seen_.assign(logits.size(), 0);
    const auto penalty = static_cast<float>(p.repetition_penalty);
    for (const int32_t t : context) {
      if (t < 0 || t >= vocab || seen_[static_cast<size_t>(t)]) continue;
      seen_[static_cast<size_t>(t)] = 1;
      float& l = logits[static_cast<size_t>(t)];
      l = l > 0 ? l / penalty : l * penalty;
    }
  }
  if (p.presence_penalty != 0 || p.frequency_penalty != 0) {
    counts_.assign(logits.size(), 0);
    for (size_t i = std::min(prompt_length, context.size()); i < context.size(); ++i)
      if (context[i] >= 0 && context[i] < vocab) ++counts_[static_cast<size_t>(context[i])];
    for (size_t t = 0; t < counts_.size(); ++t)
      if (counts_[t] > 0)
        logits[t] -= static_cast<float>(p.presence_penalty + p.frequency_penalty * counts_[t]);
  }
  // Greedy: the first maximum (lowest id on ties), as torch.argmax.
  if (p.temperature == 0) return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());

  order_.resize(logits.size());
  std::iota(order_.begin(), order_.end(), 0);
  const auto better = [&](int32_t a, int32_t b) {
    const float la = logits[static_cast<size_t>(a)], lb = logits[static_cast<size_t>(b)];
    return la > lb || (la == lb && a < b);
  };
  int32_t keep = p.top_k > 0 ? static_cast<int32_t>(std::min<int64_t>(p.top_k, vocab)) : vocab;
  std::partial_sort(order_.begin(), order_.begin() + keep, order_.end(), better);

  // Probabilities of the kept tokens at temperature T (stable: relative to the best).
  probs_.resize(static_cast<size_t>(keep));
  const double best = logits[static_cast<size_t>(order_[0])], inv_t = 1.0 / p.temperature;
  double total = 0;
  for (int32_t i = 0; i < keep; ++i) {
    probs_[static_cast<size_t>(i)] = std::exp((logits[static_cast<size_t>(order_[static_cast<size_t>(i)])] - best) * inv_t);
    total += probs_[static_cast<size_t>(i)];
  }
  if (p.top_p < 1.0) {
    double cumulative = 0;
    int32_t n = 0;
    while (n < keep) {
      cumulative += probs_[static_cast<size_t>(n++)] / total;
      if (cumulative >= p.top_p) break;
    }
    keep = std::max<int32_t>(n, 1);
  }
  if (p.min_p > 0) {
    // probs_[0] is the best; the others are relative to it already (best -> 1).
    const double threshold = p.min_p * probs_[0];
    int32_t n = 1;
    while (n < keep && probs_[static_cast<size_t>(n)] >= threshold) ++n;
    keep = n;
  }
  total = 0;
  for (int32_t i = 0; i < keep; ++i) total += probs_[static_cast<size_t>(i)];
  double u = rng.uniform() * total;
  for (int32_t i = 0; i < keep; ++i) {
    u -= probs_[static_cast<size_t>(i)];
    if (u < 0) return order_[static_cast<size_t>(i)];
  }
  return order_[static_cast<size_t>(keep - 1)];
}

void log_softmax(std::span<const float> logits, std::vector<double>& out) {
  out.resize(logits.size());
  double m = -INFINITY;
  for (const float l : logits) m = std::max(m, static_cast<double>(l));
  double sum = 0;
  for (const float l : logits) sum += std::exp(static_cast<double>(l) - m);
  const double lse = m + std::log(sum);
  for (size_t i = 0; i < logits.size(); ++i) out[i] = static_cast<double>(logits[i]) - lse;
}

std::vector<std::pair<int32_t, double>> top_logprobs(std::span<const double> logprobs, int64_t k) {
  std::vector<int32_t> ids(logprobs.size());
  std::iota(ids.begin(), ids.end(), 0);
  k = std::min<int64_t>(k, static_cast<int64_t>(ids.size()));
  std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), [&](int32_t a, int32_t b) {
    return logprobs[static_cast<size_t>(a)] > logprobs[static_cast<size_t>(b)] ||
           (logprobs[static_cast<size_t>(a)] == logprobs[static_cast<size_t>(b)] && a < b);
  });
  std::vector<std::pair<int32_t, double>> out;
  for (int64_t i = 0; i < k; ++i) out.emplace_back(ids[static_cast<size_t>(i)], logprobs[static_cast<size_t>(ids[static_cast<size_t>(i)])]);
  return out;
}

}  // namespace kiln

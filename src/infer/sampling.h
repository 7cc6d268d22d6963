// Choosing the next token from logits: the logit processors of transformers' generate(),
// in its order -- repetition penalty, temperature, top-k, top-p, min-p -- then a draw.
//   repetition_penalty p: each distinct token already in the context has its logit
//                         divided by p if positive, multiplied by p if negative (CTRL)
//   temperature T:        logits / T; T = 0 means greedy (argmax after the penalty)
//   top_k k:              keep the k most likely (0 = all)
//   top_p p:              keep the smallest most-likely set whose probability reaches p
//   min_p m:              drop tokens less likely than m * (the most likely one's probability)
// The draw uses the caller's Rng, so a fixed seed reproduces a sequence exactly.
#pragma once

#include "core/rng.h"

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

namespace kiln {

struct SamplingParams {
  double temperature = 1.0;
  int64_t top_k = 0;
  double top_p = 1.0;
  double min_p = 0.0;
  double repetition_penalty = 1.0;

  // Throws "[sampling] <name> ..." for values out of range.
  void validate() const;
};

class Sampler {
 public:
  // logits: one row of the vocabulary (modified in place by the penalty); context: the
  // tokens so far (prompt and generated) that the repetition penalty looks at.
  int32_t sample(std::span<float> logits, std::span<const int32_t> context, const SamplingParams& params, Rng& rng);

 private:
  std::vector<int32_t> order_;  // scratch reused across calls
  std::vector<double> probs_;
  std::vector<uint8_t> seen_;
};

// log-softmax of one row (in double), and the k most likely (id, logprob), best first.
void log_softmax(std::span<const float> logits, std::vector<double>& out);
std::vector<std::pair<int32_t, double>> top_logprobs(std::span<const double> logprobs, int64_t k);

}  // namespace kiln

// Choosing the next token from logits: the logit processors of transformers' generate(),
// in its order -- repetition penalty, temperature, top-k, top-p, min-p -- then a draw,
// after OpenAI's logit bias and with its presence and frequency penalties beside the
// repetition penalty (vLLM's order: bias, then the penalties, then the rest).
//   logit_bias {id: b}:   b (in [-100, 100]) added to the token's logit
//   repetition_penalty p: each distinct token already in the context has its logit
//                         divided by p if positive, multiplied by p if negative (CTRL)
//   presence_penalty a,   OpenAI's: logit -= a * [count > 0] + f * count, where count is
//   frequency_penalty f:  how often the token was generated (the prompt does not count)
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
  double presence_penalty = 0.0;   // in [-2, 2], as OpenAI
  double frequency_penalty = 0.0;  // in [-2, 2]
  std::vector<std::pair<int32_t, float>> logit_bias;  // (id, bias in [-100, 100])

  // Throws "[sampling] <name> ..." for values out of range.
  void validate() const;
  // A bias or a penalty: the logits change before the choice, so greedy decoding needs
  // the whole row, not the device's argmax.
  bool changes_logits() const;
};

class Sampler {
 public:
  // logits: one row of the vocabulary (modified in place by the bias and penalties);
  // context: the tokens so far that the repetition penalty looks at, the prompt's
  // `prompt_length` first: the presence and frequency penalties count the rest.
  int32_t sample(std::span<float> logits, std::span<const int32_t> context, const SamplingParams& params, Rng& rng,
                 size_t prompt_length = 0);

 private:
  std::vector<int32_t> order_;  // scratch reused across calls
  std::vector<double> probs_;
  std::vector<uint8_t> seen_;
  std::vector<int32_t> counts_;
};

// log-softmax of one row (in double), and the k most likely (id, logprob), best first.
void log_softmax(std::span<const float> logits, std::vector<double>& out);
std::vector<std::pair<int32_t, double>> top_logprobs(std::span<const double> logprobs, int64_t k);

}  // namespace kiln

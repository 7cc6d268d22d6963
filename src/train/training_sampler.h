// The trainer's samples (train.sample_every and the end of the run): text from the model
// being trained, through the same KV-cache Decoder, Generator and Sampler as `kiln sample`
// and `kiln serve`, on the device the model is on. So a sample chooses its tokens exactly
// as they do (a padded vocabulary's ids included: never drawn).
//
// The decoder is built once, before the first step: its cache and buffers are planned and
// allocated like the run's other memory. It reads the model's own weights in place (on the
// GPU's mixed path, the bf16 compute copies of the fp32 masters, which each sample first
// refreshes from the masters), so every sample sees the weights of its step.
#pragma once

#include "config/config.h"
#include "data/tokenizer.h"
#include "model/model.h"

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace kiln {

class Decoder;

class TrainingSampler {
 public:
  // Throws naming train.sample_tokens / train.sample_prompt if BOS + the prompt + the
  // sample do not fit model.max_seq_len (the decoder's context). Cheap: call it before
  // anything large is allocated.
  static void check_fits(const Config& config, const Tokenizer& tokenizer);

  // The model must be allocated and outlive the sampler.
  TrainingSampler(Model& model, const Tokenizer& tokenizer, const TrainConfig& train);
  ~TrainingSampler();
  TrainingSampler(const TrainingSampler&) = delete;
  TrainingSampler& operator=(const TrainingSampler&) = delete;

  // The prompt and its continuation, drawn with `seed`; nullopt when `stop` (polled between
  // decoder steps) asked for the sample to end first.
  std::optional<std::string> sample(uint64_t seed, const std::function<bool()>& stop);

 private:
  Model& model_;
  const Tokenizer& tokenizer_;
  const TrainConfig& train_;
  std::vector<int32_t> prompt_;  // BOS + the encoded train.sample_prompt
  std::unique_ptr<Decoder> decoder_;
};

}  // namespace kiln

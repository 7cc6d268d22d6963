#include "train/training_sampler.h"

#include "core/error.h"
#include "infer/decoder.h"
#include "infer/generator.h"

namespace kiln {

namespace {

std::vector<int32_t> prompt_tokens(const Tokenizer& tokenizer, const std::string& prompt) {
  std::vector<int32_t> tokens{tokenizer.bos_id()};  // a sample is a new document
  for (const int32_t id : tokenizer.encode(prompt)) tokens.push_back(id);
  return tokens;
}

}  // namespace

void TrainingSampler::check_fits(const Config& config, const Tokenizer& tokenizer) {
  const TrainConfig& t = config.train;
  if (t.sample_tokens == 0) return;
  const auto prompt = static_cast<int64_t>(prompt_tokens(tokenizer, t.sample_prompt).size());
  KILN_CHECK(prompt + t.sample_tokens <= config.model.max_seq_len, "train.sample_tokens",
             "{} tokens after the {}-token prompt (BOS + train.sample_prompt) exceed model.max_seq_len ({}); at most "
             "{} fit",
             t.sample_tokens, prompt, config.model.max_seq_len, std::max<int64_t>(0, config.model.max_seq_len - prompt));
}

TrainingSampler::TrainingSampler(Model& model, const Tokenizer& tokenizer, const TrainConfig& train)
    : model_(model), tokenizer_(tokenizer), train_(train), prompt_(prompt_tokens(tokenizer, train.sample_prompt)) {
  DecoderOptions d;
  d.slots = 1;
  d.max_len = static_cast<int64_t>(prompt_.size()) + train.sample_tokens;
  d.max_rows = std::min<int64_t>(d.max_len, 64);  // prefill chunk; decode steps are one row
  d.logit_rows = 1;                               // one sequence wants one row of logits per step
  decoder_ = std::make_unique<Decoder>(model, d);
}

TrainingSampler::~TrainingSampler() = default;

std::optional<std::string> TrainingSampler::sample(uint64_t seed, const std::function<bool()>& stop) {
  model_.refresh_compute_weights();  // the optimizer moved the masters since the last forward
  GenerationRequest request;
  request.prompt = prompt_;
  request.max_tokens = train_.sample_tokens;
  request.sampling.temperature = train_.sample_temperature;
  request.sampling.top_k = train_.sample_top_k;
  request.seed = seed;
  Generator generator(*decoder_, tokenizer_);
  GenerationResult result;
  generator.submit(std::move(request), [&result](GenerationResult&& r) { result = std::move(r); });
  while (generator.step()) {
    if (!stop()) continue;
    generator.abort("stopped");
    return std::nullopt;
  }
  return train_.sample_prompt + result.text;
}

}  // namespace kiln

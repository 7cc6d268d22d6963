// OpenAI's presence_penalty, frequency_penalty and logit_bias: the sampler's arithmetic
// checked by hand on one row, then on a tiny model's real logits (a bias of -100 on the
// greedy token makes the second choice greedy; the penalties' choice computed by hand from
// the step's full distribution), then through `kiln serve`'s /v1/completions.
#include "serve/completion_api.h"
#include "serve_fixture.h"

#include <gtest/gtest.h>

#include <algorithm>

namespace kiln {
namespace {

using nlohmann::json;

TEST(SamplingOptions, PenaltiesAndBiasByHandOnOneRow) {
  Sampler sampler;
  Rng rng(1);
  SamplingParams greedy;
  greedy.temperature = 0;
  const std::vector<float> logits = {2.0f, 3.0f, 2.6f, 0.5f};
  const std::vector<int32_t> context = {0, 1, 1, 2};  // the prompt {0}; generated 1, 1, 2

  SamplingParams frequency = greedy;
  frequency.frequency_penalty = 0.5;  // 1 twice: 3.0 - 0.5 * 2 = 2.0; 2 once: 2.6 - 0.5 = 2.1
  std::vector<float> row = logits;
  EXPECT_EQ(sampler.sample(row, context, frequency, rng, 1), 2);
  EXPECT_FLOAT_EQ(row[0], 2.0f);  // in the prompt only: not counted
  EXPECT_FLOAT_EQ(row[1], 2.0f);
  EXPECT_FLOAT_EQ(row[2], 2.1f);
  EXPECT_FLOAT_EQ(row[3], 0.5f);

  SamplingParams both = frequency;
  both.presence_penalty = 0.2;  // 1: 3.0 - 0.2 - 1.0 = 1.8; 2: 2.6 - 0.2 - 0.5 = 1.9; 0 stays 2.0
  row = logits;
  EXPECT_EQ(sampler.sample(row, context, both, rng, 1), 0);
  EXPECT_FLOAT_EQ(row[1], 1.8f);
  EXPECT_FLOAT_EQ(row[2], 1.9f);

  row = logits;  // the same tokens, all of them prompt: nothing is penalized
  EXPECT_EQ(sampler.sample(row, context, both, rng, context.size()), 1);
  EXPECT_EQ(row, logits);

  SamplingParams bias = greedy;
  bias.logit_bias = {{1, -100.0f}, {3, 1.5f}};
  row = logits;
  EXPECT_EQ(sampler.sample(row, context, bias, rng), 2);  // the second choice
  EXPECT_FLOAT_EQ(row[1], -97.0f);
  EXPECT_FLOAT_EQ(row[3], 2.0f);

  EXPECT_THROW(([] { SamplingParams p; p.presence_penalty = 2.5; p.validate(); })(), Error);
  EXPECT_THROW(([] { SamplingParams p; p.logit_bias = {{0, 101.0f}}; p.validate(); })(), Error);
}

// The model test::ServedModel serves, with a generator run to completion on this thread.
class TinyModel {
 public:
  TinyModel() {
    BuildOptions o;
    o.training = false;
    o.max_tokens = 64;
    model_ = std::make_unique<Model>(test::tiny_config(true, true, false), o);
    model_->allocate();
    test::randomize_weights(*model_, 9);
    DecoderOptions d;
    d.slots = 4;
    d.max_rows = 32;
    decoder_ = std::make_unique<Decoder>(*model_, d);
    generator_ = std::make_unique<Generator>(*decoder_, tokenizer_);
  }
  GenerationResult run(GenerationRequest request) {
    GenerationResult out;
    generator_->submit(std::move(request), [&](GenerationResult&& r) { out = std::move(r); });
    while (!generator_->idle()) generator_->step();
    return out;
  }
  static GenerationRequest greedy(std::vector<int32_t> prompt, int64_t max_tokens) {
    GenerationRequest r;
    r.prompt = std::move(prompt);
    r.max_tokens = max_tokens;
    r.sampling.temperature = 0;
    r.stop_at_eos = false;
    return r;
  }
  const ByteTokenizer& tokenizer() const { return tokenizer_; }

 private:
  ByteTokenizer tokenizer_;
  std::unique_ptr<Model> model_;
  std::unique_ptr<Decoder> decoder_;
  std::unique_ptr<Generator> generator_;
};

TEST(SamplingOptions, ABiasOfMinus100OnTheGreedyTokenMakesTheSecondChoiceGreedy) {
  TinyModel tiny;
  GenerationRequest plain = TinyModel::greedy({1, 2, 3}, 1);
  plain.logprobs = true;
  plain.top_logprobs = 2;
  const GenerationResult a = tiny.run(plain);
  ASSERT_EQ(a.tokens.size(), 1u);
  const auto& top = a.logprobs[0].top;
  ASSERT_EQ(top[0].first, a.tokens[0]);
  GenerationRequest biased = TinyModel::greedy({1, 2, 3}, 1);
  biased.sampling.logit_bias = {{a.tokens[0], -100.0f}};
  EXPECT_EQ(tiny.run(biased).tokens, std::vector<int32_t>{top[1].first});
}

// Two greedy steps; the second's whole distribution (its logprobs differ from its logits by
// one constant, so the argmax is the same) gives the penalized choice by hand: the first
// token, generated once, loses presence + frequency (negative penalties: gains). Over
// several prompts some choice must change, or the test would not be testing the penalty.
TEST(SamplingOptions, PenaltiesOnTheModelsSecondStepMatchAHandComputation) {
  TinyModel tiny;
  int changed = 0;
  for (const auto& [presence, frequency] : {std::pair{0.25, 1.5}, std::pair{-0.5, -1.5}})
    for (int32_t i = 0; i < 12; ++i) {
      const std::vector<int32_t> prompt = {i + 1, (i * 37) % 200 + 1};
      GenerationRequest plain = TinyModel::greedy(prompt, 2);
      plain.logprobs = true;
      plain.top_logprobs = ByteTokenizer::kVocab;
      const GenerationResult a = tiny.run(plain);
      ASSERT_EQ(a.tokens.size(), 2u);
      const int32_t first = a.tokens[0];
      int32_t expected = -1;
      double best = -INFINITY;
      std::vector<std::pair<int32_t, double>> row = a.logprobs[1].top;
      std::sort(row.begin(), row.end());  // by id: the first of equal maxima wins, as argmax
      for (const auto& [id, lp] : row) {
        const double v = lp - (id == first ? presence + frequency : 0.0);
        if (v > best) best = v, expected = id;
      }
      GenerationRequest penalized = TinyModel::greedy(prompt, 2);
      penalized.sampling.presence_penalty = presence;
      penalized.sampling.frequency_penalty = frequency;
      const GenerationResult b = tiny.run(penalized);
      ASSERT_EQ(b.tokens.size(), 2u);
      EXPECT_EQ(b.tokens[0], first) << "nothing was generated before the first token: no penalty";
      EXPECT_EQ(b.tokens[1], expected) << "prompt " << i << ", presence " << presence << ", frequency " << frequency;
      changed += expected != a.tokens[1];
    }
  EXPECT_GT(changed, 0);
}

// Through the server: the fields are taken (no longer refused) and give the generator's
// tokens. The served model is TinyModel's (the same weights), so its ids say what to expect.
TEST(SamplingOptions, TheServerHonoursTheFields) {
  TinyModel tiny;
  GenerationRequest plain = TinyModel::greedy({1, 2, 3}, 1);
  plain.logprobs = true;
  plain.top_logprobs = 2;
  const GenerationResult a = tiny.run(plain);
  GenerationRequest penalized = TinyModel::greedy({1, 2, 3}, 4);
  penalized.sampling.presence_penalty = 0.5;
  penalized.sampling.frequency_penalty = 2;
  const GenerationResult b = tiny.run(penalized);

  ByteTokenizer tokenizer;
  serve::ServeOptions options;
  options.model_name = "tiny";
  test::ServedModel served(tokenizer, options);
  httplib::Client c = served.client();
  auto tokens_of = [&](const json& body) {
    auto res = c.Post("/v1/completions", body.dump(), "application/json");
    EXPECT_TRUE(res);
    if (!res) return json();
    EXPECT_EQ(res->status, 200) << res->body;
    return json::parse(res->body)["choices"][0]["logprobs"]["tokens"];
  };
  const json biased = {{"prompt", {1, 2, 3}}, {"max_tokens", 1},  {"temperature", 0}, {"logprobs", 0},
                       {"ignore_eos", true},  {"logit_bias", {{std::to_string(a.tokens[0]), -100}}}};
  EXPECT_EQ(tokens_of(biased), json::array({serve::token_text(tokenizer, a.logprobs[0].top[1].first)}));
  const json penalties = {{"prompt", {1, 2, 3}},  {"max_tokens", 4},          {"temperature", 0}, {"logprobs", 0},
                          {"ignore_eos", true},   {"presence_penalty", 0.5}, {"frequency_penalty", 2}};
  json expected = json::array();
  for (int32_t t : b.tokens) expected.push_back(serve::token_text(tokenizer, t));
  EXPECT_EQ(tokens_of(penalties), expected);
}

}  // namespace
}  // namespace kiln

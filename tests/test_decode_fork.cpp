// A prompt prefilled once and continued by several sequences: Decoder::copy_slot gives a
// slot another's cached prefix, and the Generator's groups (GenerationRequest::
// shares_prefill) fork from one prefill, each sequence what it would be alone.
#include "export_fixture.h"
#include "infer/generator.h"

#include <gtest/gtest.h>

#include <cmath>

namespace kiln {
namespace {

std::unique_ptr<Model> random_model() {
  BuildOptions o;
  o.training = false;
  o.max_tokens = 64;
  auto model = std::make_unique<Model>(test::tiny_config(true, true, false), o);
  model->allocate();
  test::randomize_weights(*model, 9);
  return model;
}

std::vector<int32_t> prompt_of(size_t n) {
  std::vector<int32_t> p = {ByteTokenizer::kBos};
  for (size_t i = 1; i < n; ++i) p.push_back(static_cast<int32_t>('a' + (i * 7) % 26));
  return p;
}

// A slot given slot 0's prompt by copy answers the next token as slot 0 does; a slot that
// ran nothing does not (so the copy is what made them agree).
TEST(DecoderCopySlot, ACopiedSlotContinuesAsTheOriginal) {
  const auto model = random_model();
  DecoderOptions d;
  d.slots = 3;
  d.max_rows = 8;
  Decoder decoder(*model, d);
  const std::vector<int32_t> prompt = prompt_of(13);
  for (int32_t at = 0; at < 13; at += 8) {  // two prefill chunks
    const int32_t n = std::min<int32_t>(8, 13 - at);
    decoder.forward(std::span(prompt).subspan(static_cast<size_t>(at), static_cast<size_t>(n)),
                    std::vector<int32_t>(static_cast<size_t>(n), 0), [&] {
                      std::vector<int32_t> p;
                      for (int32_t i = at; i < at + n; ++i) p.push_back(i);
                      return p;
                    }());
  }
  decoder.copy_slot(0, 1, 13);
  const std::vector<int32_t> next = {'q', 'q', 'q'}, slots = {0, 1, 2}, at = {13, 13, 13};
  decoder.forward(next, slots, at);
  std::vector<float> logits;
  decoder.logits(std::vector<int32_t>{0, 1, 2}, logits);
  const auto v = static_cast<size_t>(decoder.vocab_size());
  double copied = 0, uncopied = 0;
  for (size_t i = 0; i < v; ++i) {
    copied = std::max<double>(copied, std::abs(logits[i] - logits[v + i]));
    uncopied = std::max<double>(uncopied, std::abs(logits[i] - logits[2 * v + i]));
  }
  EXPECT_LT(copied, 1e-5);
  EXPECT_GT(uncopied, 1e-2);
  EXPECT_THROW(decoder.copy_slot(0, 0, 4), Error);
  EXPECT_THROW(decoder.copy_slot(0, 3, 4), Error);
  EXPECT_THROW(decoder.copy_slot(0, 1, 65), Error);
}

GenerationRequest sampled(const std::vector<int32_t>& prompt, uint64_t seed, double temperature, bool logprobs) {
  GenerationRequest r;
  r.prompt = prompt;
  r.max_tokens = 10;
  r.sampling.temperature = temperature;
  r.seed = seed;
  r.stop_at_eos = false;
  r.logprobs = logprobs;
  return r;
}

// Three sequences of one 20-token prompt (three prefill chunks of 8) sampled with seeds 5,
// 6, 7 from one prefill: each equals the request with its seed run alone, and the prompt
// ran once. Greedy (the device's argmax path, no logits copied) the three are the same.
TEST(GeneratorSharedPrefill, EachSequenceIsItsSeedAloneAndThePromptRunsOnce) {
  const auto model = random_model();
  DecoderOptions d;
  d.slots = 4;
  d.max_rows = 8;
  Decoder decoder(*model, d);
  ByteTokenizer tokenizer;
  Generator generator(decoder, tokenizer);
  const std::vector<int32_t> prompt = prompt_of(20);
  std::vector<GenerationRequest> group;
  for (uint64_t c = 0; c < 3; ++c) {
    group.push_back(sampled(prompt, 5 + c, 1.0, true));
    group.back().shares_prefill = c > 0;
  }
  const auto together = generator.run(group);
  EXPECT_EQ(generator.prefilled_tokens(), 20);
  for (size_t c = 0; c < 3; ++c) {
    const auto alone = generator.run({sampled(prompt, 5 + c, 1.0, true)});
    EXPECT_EQ(together[c].tokens, alone[0].tokens) << "sequence " << c;
    ASSERT_EQ(together[c].logprobs.size(), alone[0].logprobs.size());
    for (size_t t = 0; t < alone[0].logprobs.size(); ++t)
      EXPECT_NEAR(together[c].logprobs[t].logprob, alone[0].logprobs[t].logprob, 1e-5);
  }
  EXPECT_EQ(generator.prefilled_tokens(), 80);
  EXPECT_NE(together[0].tokens, together[1].tokens) << "the seeds drew the same: the test would prove nothing";

  for (auto& r : group) r.sampling.temperature = 0, r.logprobs = false;
  const auto greedy = generator.run(group);
  EXPECT_EQ(generator.prefilled_tokens(), 100);
  EXPECT_EQ(greedy[1].tokens, greedy[0].tokens);
  EXPECT_EQ(greedy[2].tokens, greedy[0].tokens);
  EXPECT_EQ(greedy[0].tokens.size(), 10u);
  EXPECT_TRUE(generator.idle());

  // Five sequences sharing a prefill need five slots at once: refused, not left waiting.
  group.push_back(group.back());
  group.push_back(group.back());
  EXPECT_THROW(generator.run(group), Error);
}

}  // namespace
}  // namespace kiln

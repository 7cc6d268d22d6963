// The decode slot contract (BranchDecoder::reset_slot / copy_slot, nn/decode.h) for
// mixers with a fixed-size state per sequence: the Generator resets every slot it gives a
// new sequence, a shared prefill copies the leader's state to each follower, and the
// Decoder passes both to every layer. recording_gqa (mixer_doubles.h) is gqa whose
// decoder also counts the rows each slot has run, a stand-in for a recurrent state.
#include "export_fixture.h"
#include "infer/generator.h"
#include "mixer_doubles.h"

#include <gtest/gtest.h>

namespace kiln {
namespace {

using test::SlotCall;

std::unique_ptr<Model> random_model(const std::string& attention) {
  test::register_test_mixers();
  ModelConfig c = test::tiny_config(true, true, false);
  c.attention = attention;
  BuildOptions o;
  o.training = false;
  o.max_tokens = 64;
  auto model = std::make_unique<Model>(c, o);
  model->allocate();
  test::randomize_weights(*model, 9);
  return model;
}

GenerationRequest greedy(size_t prompt_length, int64_t max_tokens) {
  GenerationRequest r;
  r.prompt = {ByteTokenizer::kBos};
  for (size_t i = 1; i < prompt_length; ++i) r.prompt.push_back(static_cast<int32_t>('a' + (i * 5) % 26));
  r.max_tokens = max_tokens;
  r.sampling.temperature = 0;
  r.stop_at_eos = false;
  return r;
}

// One slot, two sequences: the second reuses the slot and starts from a reset state (its
// rows alone, not the first's too), and the recording changes no token.
TEST(DecodeSlots, AReusedSlotIsResetForItsNewSequence) {
  const auto model = random_model("recording_gqa");
  DecoderOptions d;
  d.slots = 1;
  d.max_rows = 8;
  Decoder decoder(*model, d);
  ByteTokenizer tokenizer;
  Generator generator(decoder, tokenizer);
  test::slot_calls().clear();
  const auto first = generator.run({greedy(11, 4)});
  const auto second = generator.run({greedy(6, 3)});
  const std::vector<SlotCall> reset = {{"reset", 0}, {"reset", 0}};  // once per layer
  std::vector<SlotCall> both = reset;
  both.insert(both.end(), reset.begin(), reset.end());
  EXPECT_EQ(test::slot_calls(), both);
  ASSERT_EQ(test::recording_decoders().size(), 2u);
  for (const test::RecordingDecoder* layer : test::recording_decoders())
    EXPECT_EQ(layer->rows_run(0), 6 + 3 - 1);  // the prompt, then each generated token but the last
  EXPECT_THROW(decoder.reset_slot(1), Error);

  const auto plain = random_model("gqa");
  Decoder plain_decoder(*plain, d);
  Generator plain_generator(plain_decoder, tokenizer);
  EXPECT_EQ(plain_generator.run({greedy(11, 4)})[0].tokens, first[0].tokens);
  EXPECT_EQ(plain_generator.run({greedy(6, 3)})[0].tokens, second[0].tokens);
}

// Two sequences of one prompt: both slots are reset when the group is admitted, and the
// follower takes the leader's state after the prompt (positions = the prompt), so each
// ends having run what it would alone.
TEST(DecodeSlots, ASharedPrefillCopiesTheLeadersState) {
  const auto model = random_model("recording_gqa");
  DecoderOptions d;
  d.slots = 2;
  d.max_rows = 8;
  Decoder decoder(*model, d);
  ByteTokenizer tokenizer;
  Generator generator(decoder, tokenizer);
  test::slot_calls().clear();
  std::vector<GenerationRequest> group = {greedy(13, 5), greedy(13, 5)};
  group[1].shares_prefill = true;
  const auto results = generator.run(group);
  EXPECT_EQ(results[0].tokens, results[1].tokens);
  // Slots are taken from the back of the free list: the leader gets 0, the follower 1.
  const std::vector<SlotCall> expected = {{"reset", 0}, {"reset", 0}, {"reset", 1}, {"reset", 1},
                                          {"copy", 0, 1, 13}, {"copy", 0, 1, 13}};
  EXPECT_EQ(test::slot_calls(), expected);
  for (const test::RecordingDecoder* layer : test::recording_decoders()) {
    EXPECT_EQ(layer->rows_run(0), 13 + 5 - 1);
    EXPECT_EQ(layer->rows_run(1), 13 + 5 - 1);  // 13 copied, 4 its own
  }
}

}  // namespace
}  // namespace kiln

// The token mixer as a per-layer choice (model.attention, model.alt_attention on
// model.alt_attention_layers): each layer builds the mixer its pattern names, a model of
// two mixers trains, bad names fail naming their key, QK-Clip applies to the mixers with
// query-key logits only, and an export needs every layer's mixer exportable.
#include "export_fixture.h"
#include "io/hf_config.h"
#include "mixer_doubles.h"
#include "train/trainer.h"

#include <gtest/gtest.h>

#include <filesystem>

namespace kiln {
namespace {

BuildOptions inference_build() {
  BuildOptions o;
  o.training = false;
  o.max_tokens = 8;
  return o;
}

ModelConfig two_mixers(const std::string& alt, const std::string& layers = "1") {
  ModelConfig c = test::tiny_config(true, true, false);
  c.alt_attention = alt;
  c.alt_attention_layers = layers;
  return c;
}

TEST(TokenMixers, EachLayerBuildsTheMixerItsPatternNames) {
  test::register_test_mixers();
  ModelConfig c = two_mixers("zero_mixer", "every:2");
  c.layers = 4;
  const Model model(c, inference_build());
  for (size_t l = 0; l < 4; ++l)  // zero_mixer has no logits: the mixer each layer built says which it is
    EXPECT_EQ(model.backbone().blocks()[l]->mixer().clips_qk(), l % 2 == 0) << "layer " << l;
}

TEST(TokenMixers, AnUnknownMixerNamesItsKey) {
  const std::string alt = test::error_of([] { const Model m(two_mixers("kda_nope"), inference_build()); });
  EXPECT_EQ(alt.rfind("[config] model.alt_attention: unknown token mixer 'kda_nope' (known: ", 0), 0u) << alt;
  EXPECT_EQ(alt.find('\n'), std::string::npos) << alt;
  ModelConfig c = test::tiny_config(true, true, false);
  c.attention = "kda_nope";
  const std::string main = test::error_of([&] { const Model m(c, inference_build()); });
  EXPECT_EQ(main.rfind("[config] model.attention: unknown token mixer 'kda_nope'", 0), 0u) << main;
}

// The losses of a short run, from its metrics.jsonl.
std::vector<double> train_losses(const std::string& dir, const std::string& alt_attention) {
  std::vector<std::string> overrides = {
      "data.path=" + test::source_dir() + "/data/tinyshakespeare.txt", "train.out_dir=" + dir, "train.device=cpu",
      "model.hidden=32", "model.layers=2", "model.heads=4", "model.kv_heads=2", "model.head_dim=8",
      "model.ffn_hidden=64", "model.max_seq_len=64", "train.micro_batch_tokens=128", "train.steps=2",
      "train.eval_every=0", "train.eval_batches=1", "train.sample_every=0", "train.sample_tokens=8", "log.every=1",
      "train.threads=2", "checkpoint.save_final=false"};
  if (!alt_attention.empty()) {
    overrides.push_back("model.alt_attention=" + alt_attention);
    overrides.push_back("model.alt_attention_layers=1");
  }
  Trainer trainer(load_config("", overrides));
  trainer.run();
  return test::train_losses(dir);
}

// Layer 1 on recording_gqa (gqa under another name, registered here, so the trainer's
// name check and the per-layer build both go through the registry): the same parameters
// in the same order and the same math, so the run is the plain one to the bit.
TEST(TokenMixers, AModelOfTwoMixersTrainsOnTheCpu) {
  test::register_test_mixers();
  const std::string root = test::temp_dir("kiln-token-mixers");
  const std::vector<double> plain = train_losses(root + "/plain", "");
  const std::vector<double> mixed = train_losses(root + "/mixed", "recording_gqa");
  ASSERT_EQ(plain.size(), 2u);
  EXPECT_EQ(mixed, plain);
  std::filesystem::remove_all(root);
}

TEST(TokenMixers, QkClipNeedsAMixerWithLogits) {
  test::register_test_mixers();
  BuildOptions o = inference_build();
  o.training = true;
  o.qk_clip_tau = 100;
  ModelConfig none = test::tiny_config(true, true, false);
  none.attention = "zero_mixer";
  const std::string error = test::error_of([&] { const Model m(none, o); });
  EXPECT_EQ(error.rfind("[config] optim.qk_clip.enabled = true: no layer's token mixer has query-key logits", 0), 0u)
      << error;
  const Model some(two_mixers("zero_mixer"), o);  // layer 0's gqa clips; layer 1 has nothing to clip
  EXPECT_TRUE(some.backbone().blocks()[0]->mixer().clips_qk());
  EXPECT_FALSE(some.backbone().blocks()[1]->mixer().clips_qk());
}

// The config.json of a model's layers, or the refusal.
std::string hf_config_or_refusal(const ModelConfig& c) {
  try {
    const Model model(c, inference_build());
    return io::hf_config_json(model, io::choose_hf_arch(c), {}, "float32").dump();
  } catch (const Error& e) {
    return e.what();
  }
}

TEST(TokenMixers, AnExportNeedsEveryLayersMixerExportable) {
  test::register_test_mixers();
  // Two names for one exportable mixer: the export is the plain model's.
  EXPECT_EQ(hf_config_or_refusal(two_mixers("recording_gqa")), hf_config_or_refusal(test::tiny_config(true, true, false)));
  // A layer whose mixer no stock family computes: refused under the key that chose it.
  EXPECT_EQ(hf_config_or_refusal(two_mixers("zero_mixer")).rfind("[export] model.alt_attention = 'zero_mixer': ", 0), 0u)
      << hf_config_or_refusal(two_mixers("zero_mixer"));
}

}  // namespace
}  // namespace kiln

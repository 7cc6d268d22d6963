// The "mla" token mixer (nn/mla_mixer.h) in whole models on the CPU: every parameter's
// gradient of an "mla, gqa" model and of an all-"mla" one against finite differences in f64
// (five-point stencil over a packed batch of three documents and a PAD tail, as
// test_kda_mixer.cpp), with d_qk != d_v both ways; the absorbed decoder's logits against the
// full forward in f64 (chunks and single tokens of two sequences in one step, a reused slot,
// a forked one); QK-Clip bringing the batch's largest logit to tau while W_vb stays; names
// and refusals; and a short training run on the bundled corpus whose loss falls.
#include "full_forward.h"
#include "grad_check.h"
#include "infer/decoder.h"
#include "tiny_model.h"
#include "train/trainer.h"
#include "test_util.h"

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <map>

namespace kiln {
namespace {

using namespace kiln::test;

// `layers` layers, the first "mla" and the others `other` (mla too if empty).
ModelConfig with_mla(ModelConfig c, int64_t layers, const std::string& other, int64_t dqk, int64_t dv) {
  c.layers = layers;
  c.attention = "mla";
  if (!other.empty()) c.alt_attention = other, c.alt_attention_layers = "from:1";
  c.mla.kv_rank = 5;  // not a multiple of anything else here
  c.mla.qk_head_dim = dqk;
  c.mla.v_head_dim = dv;
  return c;
}

void check_all_gradients(const ModelConfig& c, const char* label) {
  const HostBatch batch = pack_docs(three_docs(), 4);
  Model m(c, tiny_build(24, 7));
  m.allocate();
  init_tiny_model(m, 7);
  m.load_batch(batch);
  const double scale = 1.0 / static_cast<double>(batch.target_count);
  m.zero_grads();
  const LossSums fb = m.forward_backward(scale);
  EXPECT_NEAR(fb.loss, m.evaluate().loss, 1e-13 * fb.loss);
  ScopedCpuThreads one_thread(1);
  const auto objective = [&] { return m.evaluate().loss * scale; };
  SCOPED_TRACE(label);
  const ParameterGradientReport report = expect_parameter_gradients_match(m, objective);
  EXPECT_NE(m.find_parameter("layers.0.mla.kv_a_layernorm.weight"), nullptr);
  std::printf("[ %s ] %s\n", label, report.str().c_str());
}

TEST(MlaMixer, HybridModelMatchesFiniteDifferences) {
  check_all_gradients(with_mla(tiny_config(true, false), 2, "gqa", 6, 3), "mla + gqa, d_qk 6 > d_v 3");
}

TEST(MlaMixer, MlaOnlyModelMatchesFiniteDifferences) {
  check_all_gradients(with_mla(tiny_config(false, true), 2, "", 3, 5), "mla x2, d_qk 3 < d_v 5");
}

TEST(MlaMixer, NamesAndShapes) {
  ModelConfig c = with_mla(tiny_config(true, true), 2, "gqa", 6, 3);
  Model m(c, tiny_build());
  m.allocate();
  m.init_weights(3);
  const Parameter* kb = m.find_parameter("layers.0.mla.k_b_proj.weight");
  ASSERT_NE(kb, nullptr);
  EXPECT_EQ(kb->names().hf, "model.layers.0.self_attn.k_b_proj.weight");
  EXPECT_EQ(kb->shape(), (Shape{c.heads * 6, 5}));
  EXPECT_EQ(m.find_parameter("layers.0.mla.v_b_proj.weight")->shape(), (Shape{c.heads * 3, 5}));
  EXPECT_EQ(m.find_parameter("layers.0.mla.q_proj.weight")->shape(), (Shape{c.heads * 6, c.hidden}));
  EXPECT_EQ(m.find_parameter("layers.0.mla.kv_a_proj.weight")->shape(), (Shape{5, c.hidden}));
  EXPECT_EQ(m.find_parameter("layers.0.mla.o_proj.weight")->shape(), (Shape{c.hidden, c.heads * 3}));
  EXPECT_EQ(m.find_parameter("layers.1.mla.q_proj.weight"), nullptr);  // layer 1 is gqa
  // kv_rank 0 defaults to hidden / 4.
  c.mla.kv_rank = 0;
  Model d(c, tiny_build());
  EXPECT_EQ(d.find_parameter("layers.0.mla.kv_a_layernorm.weight")->shape(), (Shape{c.hidden / 4}));
}

TEST(MlaMixer, UnsupportedOptionsAreRefusedByKey) {
  ModelConfig c = with_mla(tiny_config(true, true), 2, "gqa", 4, 4);
  c.attention_softcap = 30;
  const std::string softcap = error_of([&] { const Model m(c, tiny_build()); });
  EXPECT_EQ(softcap.rfind("[model.attention_softcap]", 0), 0u) << softcap;
  c.attention_softcap = 0;
  c.hidden = 3, c.mla.kv_rank = 0;  // hidden / 4 = 0
  const std::string rank = error_of([&] { const Model m(c, tiny_build()); });
  EXPECT_EQ(rank.rfind("[model.mla.kv_rank]", 0), 0u) << rank;
}

// A GPU build plans (planning allocates nothing, so no GPU is needed to see it), in fp32
// and bf16; a head too wide for the GPU's attention is refused naming its key.
TEST(MlaMixer, GpuBuildPlansAndRefusesHeadsTooWideByKey) {
  BuildOptions gpu = tiny_build();
  gpu.device = Device::cuda, gpu.dtype = DType::f32;
  ModelConfig c = with_mla(tiny_config(true, true), 2, "gqa", 6, 3);
  { const Model m(c, gpu); }
  gpu.dtype = DType::bf16;
  { const Model m(c, gpu); }
  c.mla.qk_head_dim = 251;  // 256 once padded to a multiple of 8: still fits
  { const Model m(c, gpu); }
  c.mla.qk_head_dim = 257;
  const std::string qk = error_of([&] { const Model m(c, gpu); });
  EXPECT_EQ(qk.rfind("[model.mla.qk_head_dim] = 257: 'mla' on the GPU", 0), 0u) << qk;
  c.mla.qk_head_dim = 4, c.mla.v_head_dim = 300;
  const std::string v = error_of([&] { const Model m(c, gpu); });
  EXPECT_EQ(v.rfind("[model.mla.v_head_dim] = 300: 'mla' on the GPU", 0), 0u) << v;
}

// Every parameter N(0, 0.3) (gains around 1): no part of the math trivial.
void randomize(Model& m, uint64_t seed) {
  Rng rng(seed);
  for (const auto& p : m.parameters()) {
    const bool gain = p->name().find("norm") != std::string::npos;
    double* v = p->value().data<double>();
    for (int64_t i = 0; i < p->value().numel(); ++i) v[i] = (gain ? 1.0 : 0.0) + 0.3 * rng.normal();
  }
}

TEST(MlaMixer, AbsorbedDecoderMatchesFullForward) {
  ModelConfig c;
  c.vocab_size = 259, c.hidden = 32, c.heads = 3, c.kv_heads = 1, c.head_dim = 8, c.ffn_hidden = 48;
  c.max_seq_len = 32;
  c = with_mla(c, 2, "gqa", 7, 5);
  c.mla.kv_rank = 6;
  BuildOptions o;
  o.dtype = DType::f64;
  o.training = false;
  o.max_tokens = c.max_seq_len;
  Model model(c, o);
  model.allocate();
  randomize(model, 5);
  DecoderOptions d;
  d.slots = 2, d.max_rows = 6;
  Decoder decoder(model, d);
  const double worst = slot_script_decode_error(model, decoder);
  EXPECT_LT(worst, 1e-12) << "absorbed decoder logits vs full forward";
  std::printf("mla decode: %d steps, worst scaled error %.2e\n", kSlotScriptSteps, worst);
}

// The latent is the cached attention's head (at most 512 wide, CPU and GPU): a wider one is
// refused when a decoder is made, in one line naming the key; 512 decodes.
TEST(MlaMixer, DecodeRefusesALatentWiderThan512ByKey) {
  BuildOptions o;
  o.dtype = DType::f32;
  o.training = false;
  DecoderOptions d;
  d.slots = 1, d.max_rows = 2;
  for (const int64_t rank : {512, 513}) {
    ModelConfig c = with_mla(tiny_config(true, true), 2, "gqa", 4, 4);
    c.mla.kv_rank = rank;
    o.max_tokens = c.max_seq_len;
    Model model(c, o);
    model.allocate();
    if (rank == 512) {
      const Decoder decoder(model, d);
      continue;
    }
    const std::string e = error_of([&] { const Decoder decoder(model, d); });
    EXPECT_EQ(e.rfind("[model.mla.kv_rank] = 513: 'mla' decodes over latents at most 512 wide", 0), 0u) << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  }
}

// The model's largest logit over layers and its clipped heads, from the last step's report.
std::pair<double, double> last_step_logits(const Model& m) {
  double largest = -INFINITY, clipped = 0;
  for (const auto& [name, value] : m.component_metrics()) {
    if (name.ends_with(".max_logit")) largest = std::max(largest, value);
    if (name.ends_with(".clipped")) clipped += value;
  }
  return {largest, clipped};
}

struct ClipRun {
  double before = 0, after = 0, clipped = 0;
  std::map<std::string, std::vector<double>> weights_before, weights_after;
};

// Two training forwards of one batch with a clip between them and no optimizer step.
ClipRun clip_between_forwards(const ModelConfig& c, double tau) {
  BuildOptions o = tiny_build();
  o.qk_clip_tau = tau;
  Model m(c, o);
  m.allocate();
  init_tiny_model(m, 5);
  // Larger q and k rows than init's: logits well away from zero.
  for (const auto& p : m.parameters())
    if (p->name().find("q_proj") != std::string::npos || p->name().find("k_b_proj") != std::string::npos)
      for (int64_t i = 0; i < p->value().numel(); ++i) p->value().data<double>()[i] *= 30;
  ClipRun r;
  for (const auto& p : m.parameters()) r.weights_before[p->name()] = values_of(p->value());
  m.load_batch(pack_docs(three_docs(), 4));
  m.zero_grads();
  m.forward_backward(0.05);
  m.after_step(true);
  std::tie(r.before, r.clipped) = last_step_logits(m);
  for (const auto& p : m.parameters()) r.weights_after[p->name()] = values_of(p->value());
  m.forward_backward(0.05);
  m.after_step(false);  // the report's maxima, without another clip
  r.after = last_step_logits(m).first;
  return r;
}

TEST(MlaMixer, QkClipBringsTheLargestLogitToTauAndLeavesValues) {
  const ModelConfig c = with_mla(tiny_config(false, false), 2, "", 6, 3);
  const double largest = clip_between_forwards(c, 1e30).before;
  ASSERT_TRUE(std::isfinite(largest) && largest > 0) << largest;
  const double tau = 0.5 * largest;
  const ClipRun r = clip_between_forwards(c, tau);
  EXPECT_NEAR(r.before, largest, 1e-6 * largest);
  EXPECT_GE(r.clipped, 1);
  EXPECT_NEAR(r.after, tau, 1e-5 * tau);  // the factors are f32
  // Only q_proj and k_b_proj moved (and at least one of each).
  int moved_q = 0, moved_k = 0;
  for (const auto& [name, before] : r.weights_before) {
    const bool moved = r.weights_after.at(name) != before;
    const bool q = name.find("q_proj") != std::string::npos, k = name.find("k_b_proj") != std::string::npos;
    if (!q && !k) EXPECT_FALSE(moved) << name;
    moved_q += q && moved, moved_k += k && moved;
  }
  EXPECT_GE(moved_q, 1);
  EXPECT_GE(moved_k, 1);
  std::printf("mla qk-clip: max logit %.4f, tau %.4f -> %.4f (%g heads clipped)\n", r.before, tau, r.after, r.clipped);
}

// The losses of a short CPU run of an "mla, gqa" model on the bundled corpus.
TEST(MlaMixer, HybridModelLearnsOnTheCpu) {
  const std::string dir = temp_dir("kiln-mla-train");
  const std::vector<std::string> overrides = {
      "data.path=" + source_dir() + "/data/tinyshakespeare.txt", "train.out_dir=" + dir, "train.device=cpu",
      "model.hidden=32", "model.layers=2", "model.heads=4", "model.kv_heads=2", "model.head_dim=8",
      "model.ffn_hidden=64", "model.max_seq_len=64", "model.attention=mla", "model.alt_attention=gqa",
      "model.alt_attention_layers=1", "model.mla.kv_rank=16", "model.mla.v_head_dim=6", "train.micro_batch_tokens=256",
      "train.steps=30", "train.eval_every=0", "train.eval_batches=1", "train.sample_every=0", "train.sample_tokens=8",
      "log.every=1", "train.threads=2", "checkpoint.save_final=false", "optim.warmup_steps=5"};
  Trainer trainer(load_config("", overrides));
  trainer.run();
  const std::vector<double> losses = train_losses(dir);
  ASSERT_EQ(losses.size(), 30u);
  for (double l : losses) EXPECT_TRUE(std::isfinite(l));
  const double last = (losses[25] + losses[26] + losses[27] + losses[28] + losses[29]) / 5;
  std::printf("mla hybrid: loss %.3f -> %.3f over 30 steps\n", losses[0], last);
  EXPECT_LT(last, losses[0] - 1.0);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kiln

// The "kda" token mixer (nn/kda_mixer.h) in whole models on the CPU: every parameter's
// gradient of a hybrid "kda, kda, kda, gqa" model against finite differences in f64 (as
// test_modules_grad.cpp: five-point stencil, e = 1e-4, relative error < 1e-6 over a packed
// batch of three documents and a PAD tail); the decoder's logits against the full forward in
// f64 (chunks and single tokens of two sequences in one step, a reused slot, a forked one),
// and through the Generator (a reused slot, a shared prefill) the tokens of each sequence
// alone; its names and init; the activations it keeps (backward recomputes the convolution's
// output); and a short training run on the bundled corpus whose loss falls.
#include "full_forward.h"
#include "grad_check.h"
#include "infer/decoder.h"
#include "infer/generator.h"
#include "nn/kda_mixer.h"
#include "ops/kda/kda.h"
#include "tiny_model.h"
#include "train/trainer.h"
#include "test_util.h"

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

namespace kiln {
namespace {

using namespace kiln::test;

// Three KDA layers, then one of grouped-query attention (the Kimi Linear pattern).
ModelConfig hybrid(ModelConfig c) {
  c.layers = 4;
  c.attention = "kda";
  c.alt_attention = "gqa";
  c.alt_attention_layers = "every:4";
  return c;
}

TEST(KdaMixer, HybridModelMatchesFiniteDifferences) {
  ModelConfig c = hybrid(tiny_config(true, false));
  c.kda.gate_rank = 3;  // != head_dim: the low-rank shapes are not square by accident
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
  std::printf("[ kda x3 + gqa ] %s\n", expect_parameter_gradients_match(m, objective).str().c_str());
}

// model.kda.gpu_kernel = "auto" (the default): the chunked kernels with bf16 chunk gradients
// where they take the head_dim, the recurrent ones beyond; named kernels stay as named.
TEST(KdaMixer, AutoGpuKernelIsChunkedBf16WhereTheHeadDimAllows) {
  if (ops::kda_chunked_max_dk() == 0) GTEST_SKIP() << "a build without CUDA has no GPU kernels to choose";
  EXPECT_EQ(Config{}.model.kda.gpu_kernel, "auto");
  EXPECT_EQ(kda_gpu_kernel("auto", 64), "chunked_bf16");
  EXPECT_EQ(kda_gpu_kernel("auto", ops::kda_chunked_max_dk()), "chunked_bf16");
  EXPECT_EQ(kda_gpu_kernel("auto", ops::kda_chunked_max_dk() + 1), "recurrent");
  for (const char* named : {"recurrent", "chunked", "chunked_bf16"}) EXPECT_EQ(kda_gpu_kernel(named, 64), named);
}

TEST(KdaMixer, NamesShapesAndInit) {
  ModelConfig c = hybrid(tiny_config(true, true));
  Model m(c, tiny_build());
  m.allocate();
  m.init_weights(3);
  const Parameter* a_log = m.find_parameter("layers.0.kda.A_log");
  ASSERT_NE(a_log, nullptr);
  EXPECT_EQ(a_log->names().hf, "model.layers.0.self_attn.A_log");
  EXPECT_EQ(a_log->shape(), (Shape{c.heads}));
  for (double v : values_of(a_log->value())) EXPECT_TRUE(v >= 0 && v <= std::log(16.0)) << v;
  // dt_bias = softplus^-1(dt), dt in [0.001, 0.1]
  for (double v : values_of(m.find_parameter("layers.2.kda.dt_bias")->value())) {
    const double dt = std::log1p(std::exp(v));
    EXPECT_TRUE(dt >= 0.001 * (1 - 1e-9) && dt <= 0.1 * (1 + 1e-9)) << dt;
  }
  EXPECT_EQ(m.find_parameter("layers.1.kda.q_conv1d.weight")->shape(), (Shape{c.heads * c.head_dim, 4}));
  EXPECT_EQ(m.find_parameter("layers.1.kda.o_proj.weight")->names().hf, "model.layers.1.self_attn.o_proj.weight");
  EXPECT_EQ(m.find_parameter("layers.3.kda.A_log"), nullptr);  // layer 3 is attention
  EXPECT_NE(m.find_parameter("layers.3.attn.o_proj.weight"), nullptr);
}

// The activation bytes a training build of the hybrid model plans with `kda_heads` KDA
// heads of 8 (32 f64 tokens: every saved tensor a multiple of the arena's 256-byte alignment).
size_t kda_activation_bytes(int64_t kda_heads) {
  ModelConfig c = hybrid(tiny_config(true, false));
  c.kda.heads = kda_heads, c.kda.head_dim = 8, c.kda.gate_rank = 4;
  return Model(c, tiny_build(32, 7)).memory_plan().activations;
}

// Backward recomputes q|k|v after the convolution and SiLU from its input (the finite-
// difference and training tests check it gets the same values), so each KDA layer keeps per
// token and head 6 d + 1 values: q|k|v before the convolution (3 d), the decay gate's input,
// the delta rule's output and the output gate's input (d each) and beta's input (1); keeping
// the convolution's output too would be 9 d + 1.
TEST(KdaMixer, BackwardRecomputesTheConvolutionInsteadOfKeepingItsOutput) {
  const size_t per_head = 3 * 32 * (6 * 8 + 1) * sizeof(double);  // 3 KDA layers, 32 tokens
  EXPECT_EQ(kda_activation_bytes(3) - kda_activation_bytes(2), per_head);
  EXPECT_EQ(kda_activation_bytes(5) - kda_activation_bytes(2), 3 * per_head);
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

// A "kda, kda, kda, gqa" model of f64 weights, random, with KDA heads of its own width.
std::unique_ptr<Model> decode_model() {
  ModelConfig c;
  c.vocab_size = 259, c.hidden = 32, c.heads = 2, c.kv_heads = 1, c.head_dim = 8, c.ffn_hidden = 48;
  c.max_seq_len = 32;
  c = hybrid(c);
  c.kda.heads = 3;  // its own heads and width, unlike the attention layer's
  c.kda.head_dim = 6;
  BuildOptions o;
  o.dtype = DType::f64;
  o.training = false;
  o.max_tokens = c.max_seq_len;
  auto model = std::make_unique<Model>(c, o);
  model->allocate();
  randomize(*model, 5);
  return model;
}

TEST(KdaMixer, DecoderMatchesFullForward) {
  const auto owned = decode_model();
  Model& model = *owned;
  DecoderOptions d;
  d.slots = 2;
  d.max_rows = 6;
  Decoder decoder(model, d);
  const double worst = slot_script_decode_error(model, decoder);
  EXPECT_LT(worst, 1e-12) << "decoder logits vs full forward";
  std::printf("kda decode: %d logit rows, worst scaled error %.2e\n", kSlotScriptRows, worst);
}

GenerationRequest greedy(int32_t first, size_t prompt_length, int64_t max_tokens) {
  GenerationRequest r;
  for (size_t i = 0; i < prompt_length; ++i) r.prompt.push_back(static_cast<int32_t>((first + 37 * i) % 256));
  r.max_tokens = max_tokens;
  r.sampling.temperature = 0;
  r.stop_at_eos = false;
  return r;
}

// The Generator resets a reused slot and copies a shared prefill's state: each sequence's
// tokens are those it gets alone in a fresh decoder.
TEST(KdaMixer, GeneratorResetsAndForksTheState) {
  const auto model = decode_model();
  ByteTokenizer tokenizer;
  const auto alone = [&](GenerationRequest r) {
    r.shares_prefill = false;
    DecoderOptions d;
    d.slots = 1, d.max_rows = 8;
    Decoder decoder(*model, d);
    Generator generator(decoder, tokenizer);
    return generator.run({r})[0].tokens;
  };
  const GenerationRequest first = greedy(3, 11, 6), second = greedy(50, 6, 6);
  DecoderOptions one;
  one.slots = 1, one.max_rows = 8;
  Decoder reused(*model, one);
  Generator serial(reused, tokenizer);
  EXPECT_EQ(serial.run({first})[0].tokens, alone(first));
  EXPECT_EQ(serial.run({second})[0].tokens, alone(second));  // slot 0 again, from zero

  DecoderOptions two;
  two.slots = 2, two.max_rows = 8;
  Decoder forked(*model, two);
  Generator group(forked, tokenizer);
  std::vector<GenerationRequest> pair = {greedy(9, 13, 5), greedy(9, 13, 5)};
  pair[1].shares_prefill = true;
  // The follower, greedy too, may not take the leader's second token: its own way after it.
  pair[1].sampling.logit_bias = {{alone(pair[0])[1], -100.0f}};
  const auto results = group.run(pair);
  EXPECT_EQ(results[0].tokens, alone(pair[0]));
  EXPECT_EQ(results[1].tokens, alone(pair[1]));
  EXPECT_NE(results[0].tokens, results[1].tokens);
}

// (A GPU build is no longer refused: tests/gpu/test_gpu_kda_mixer.cpp runs it.)
TEST(KdaMixer, BadKernelIsRefusedByKey) {
  ModelConfig c = tiny_config(true, true);
  c.kda.conv_kernel = 1;
  c.alt_attention = "kda", c.alt_attention_layers = "1";
  const std::string kernel = error_of([&] { const Model m(c, tiny_build()); });
  EXPECT_EQ(kernel.rfind("[model.kda.conv_kernel] = 1:", 0), 0u) << kernel;
}

// The losses of a short CPU run of a "kda, gqa" model on the bundled corpus.
TEST(KdaMixer, HybridModelLearnsOnTheCpu) {
  const std::string dir = temp_dir("kiln-kda-train");
  const std::vector<std::string> overrides = {
      "data.path=" + source_dir() + "/data/tinyshakespeare.txt", "train.out_dir=" + dir, "train.device=cpu",
      "model.hidden=32", "model.layers=2", "model.heads=4", "model.kv_heads=2", "model.head_dim=8",
      "model.ffn_hidden=64", "model.max_seq_len=64", "model.attention=kda", "model.alt_attention=gqa",
      "model.alt_attention_layers=1", "train.micro_batch_tokens=256", "train.steps=30", "train.eval_every=0",
      "train.eval_batches=1", "train.sample_every=0", "train.sample_tokens=8", "log.every=1", "train.threads=2",
      "checkpoint.save_final=false", "optim.warmup_steps=5"};
  Trainer trainer(load_config("", overrides));
  trainer.run();
  const std::vector<double> losses = train_losses(dir);
  ASSERT_EQ(losses.size(), 30u);
  for (double l : losses) EXPECT_TRUE(std::isfinite(l));
  // The mean of the last five steps well below the first step's (byte-level: ln 259 = 5.56 at start).
  const double last = (losses[25] + losses[26] + losses[27] + losses[28] + losses[29]) / 5;
  std::printf("kda hybrid: loss %.3f -> %.3f over 30 steps\n", losses[0], last);
  EXPECT_LT(last, losses[0] - 1.0);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kiln

// Dropout (ops/dropout, model.dropout, model.embed_dropout, model.attention_dropout): the mask drops the rate it
// is given and scales what it keeps; it is a function of (key, site, index), so the same
// key finds the same mask and another key or site another; the whole model's gradient with
// dropout on matches finite differences of its own dropped loss (the backward finds the
// forward's masks); evaluation drops nothing; and the trainer's keys differ by step,
// micro-batch and rank. (The attention op's own dropout: tests/op_table/cases_attention.cpp.)
#include "config/config.h"
#include "grad_check.h"
#include "io/hf_config.h"
#include "ops/attention/attention.h"
#include "ops/dropout/dropout.h"
#include "ops/dropout/dropout_mask.h"
#include "test_util.h"
#include "tiny_model.h"

#include <gtest/gtest.h>

#include <cmath>
#include <set>

namespace kiln {
namespace {

using namespace kiln::test;

// The key as the model's input buffer holds it: i32 [2], low word first.
OwnedTensor key_tensor(uint64_t key) {
  OwnedTensor t(DType::i32, Device::cpu, Shape{2});
  t->data<int32_t>()[0] = static_cast<int32_t>(static_cast<uint32_t>(key));
  t->data<int32_t>()[1] = static_cast<int32_t>(static_cast<uint32_t>(key >> 32));
  return t;
}

OwnedTensor dropped(const Tensor& x, double p, uint32_t site, uint64_t key) {
  OwnedTensor y(x.dtype(), Device::cpu, x.shape());
  const OwnedTensor k = key_tensor(key);
  ops::dropout_apply(process_exec(), x, {p, site, *k}, *y);
  return y;
}

// Ones in, so a kept element reads 1 / (1 - p) and a dropped one 0.
TEST(Dropout, DropsTheRateAndScalesWhatItKeeps) {
  constexpr int64_t kRows = 1000, kCols = 1000;
  OwnedTensor ones(DType::f64, Device::cpu, Shape{kRows, kCols});
  for (int64_t i = 0; i < ones->numel(); ++i) ones->data<double>()[i] = 1.0;
  for (const double p : {0.1, 0.5, 0.9}) {
    const OwnedTensor y = dropped(*ones, p, 3, 0x1234abcdull);
    int64_t kept = 0;
    for (int64_t i = 0; i < y->numel(); ++i) {
      const double v = y->data<double>()[i];
      ASSERT_TRUE(v == 0.0 || v == 1.0 / (1.0 - p)) << v;
      kept += v != 0.0;
    }
    // 1e6 Bernoulli draws: 5 standard deviations of the kept share.
    const double share = static_cast<double>(kept) / static_cast<double>(y->numel());
    const double sigma = std::sqrt(p * (1 - p) / static_cast<double>(y->numel()));
    EXPECT_NEAR(share, 1 - p, 5 * sigma) << "p " << p;
  }
  // p = 0 keeps everything as it is.
  const OwnedTensor x = random_tensor(DType::f64, Shape{7, 9}, 5);
  const OwnedTensor same = dropped(*x, 0.0, 1, 99);
  for (int64_t i = 0; i < x->numel(); ++i) EXPECT_EQ(same->data<double>()[i], x->data<double>()[i]);
}

TEST(Dropout, TheMaskIsAFunctionOfKeySiteAndIndex) {
  const OwnedTensor x = random_tensor(DType::f32, Shape{64, 48}, 8);
  auto mask = [&](uint32_t site, uint64_t key) {
    const OwnedTensor y = dropped(*x, 0.5, site, key);
    std::vector<bool> m(static_cast<size_t>(y->numel()));
    for (int64_t i = 0; i < y->numel(); ++i) m[static_cast<size_t>(i)] = y->data<float>()[i] != 0.0f;
    return m;
  };
  const auto base = mask(1, 42);
  EXPECT_EQ(mask(1, 42), base);  // found again: the backward's and a recompute's mask
  auto agreement = [&](const std::vector<bool>& other) {
    int64_t same = 0;
    for (size_t i = 0; i < base.size(); ++i) same += base[i] == other[i];
    return static_cast<double>(same) / static_cast<double>(base.size());
  };
  // Independent masks at p = 0.5 agree on half the elements (3072 of them: within 0.1).
  EXPECT_NEAR(agreement(mask(2, 42)), 0.5, 0.1);  // another site
  EXPECT_NEAR(agreement(mask(1, 43)), 0.5, 0.1);  // another key
  // In place, as the block applies it to its branch output.
  OwnedTensor inplace(DType::f32, Device::cpu, x->shape());
  copy_tensor(*x, *inplace);
  const OwnedTensor k = key_tensor(42);
  ops::dropout_apply(process_exec(), *inplace, {0.5, 1, *k}, *inplace);
  const OwnedTensor out = dropped(*x, 0.5, 1, 42);
  for (int64_t i = 0; i < x->numel(); ++i) EXPECT_EQ(inplace->data<float>()[i], out->data<float>()[i]);
}

TEST(Dropout, StreamKeysDifferByStepMicroBatchAndRank) {
  std::set<uint64_t> keys;
  for (int64_t step = 0; step < 20; ++step)
    for (int64_t micro = 0; micro < 4; ++micro)
      for (int64_t rank = 0; rank < 4; ++rank) keys.insert(dropout::stream_key(1337, step, micro, rank));
  EXPECT_EQ(keys.size(), 20u * 4u * 4u);
  EXPECT_EQ(dropout::stream_key(1337, 5, 1, 0), dropout::stream_key(1337, 5, 1, 0));
  EXPECT_NE(dropout::stream_key(1337, 5, 1, 0), dropout::stream_key(1338, 5, 1, 0));
}

ModelConfig dropout_config() {
  ModelConfig c = tiny_config(true, false);
  c.dropout = 0.3;
  c.embed_dropout = 0.2;
  c.attention_dropout = 0.25;
  return c;
}

// Evaluation drops nothing (the same weights without dropout give the same loss, bit for
// bit); the training forward drops (another loss), and its key decides its masks.
TEST(Dropout, OnlyTheTrainingForwardDrops) {
  HostBatch batch = pack_docs(three_docs(), 4);
  batch.dropout_key = 77;
  auto loss = [&](const ModelConfig& c, bool train, uint64_t key) {
    Model m(c, tiny_build());
    m.allocate();
    init_tiny_model(m, 7);
    batch.dropout_key = key;
    m.load_batch(batch);
    return train ? m.forward_backward(1.0).loss : m.evaluate().loss;
  };
  ModelConfig plain = dropout_config();
  plain.dropout = plain.embed_dropout = plain.attention_dropout = 0;
  const double evaluated = loss(dropout_config(), false, 77);
  EXPECT_EQ(evaluated, loss(plain, false, 77));
  EXPECT_EQ(loss(plain, true, 77), evaluated);  // without dropout, training's forward is evaluation's
  const double trained = loss(dropout_config(), true, 77);
  EXPECT_NE(trained, evaluated);
  EXPECT_EQ(loss(dropout_config(), true, 77), trained);
  EXPECT_NE(loss(dropout_config(), true, 78), trained);
  // Each kind alone reaches the loss.
  ModelConfig embed_only = plain, residual_only = plain, attention_only = plain;
  embed_only.embed_dropout = 0.2;
  residual_only.dropout = 0.3;
  attention_only.attention_dropout = 0.25;
  EXPECT_NE(loss(embed_only, true, 77), evaluated);
  EXPECT_NE(loss(residual_only, true, 77), evaluated);
  const double attention_trained = loss(attention_only, true, 77);
  EXPECT_NE(attention_trained, evaluated);
  EXPECT_EQ(loss(attention_only, false, 77), evaluated);  // validation's forward drops nothing
  EXPECT_EQ(loss(attention_only, true, 77), attention_trained);
  EXPECT_NE(loss(attention_only, true, 78), attention_trained);
}

// The whole model's gradient against finite differences of its dropped loss (a fixed key:
// fixed masks), every parameter; the masks must act (the loss differs from evaluation's).
void check_dropped_gradients(const ModelConfig& c, uint64_t key) {
  HostBatch batch = pack_docs(three_docs(), 4);
  batch.dropout_key = key;
  Model m(c, tiny_build());
  m.allocate();
  init_tiny_model(m, 11);
  m.load_batch(batch);
  const double scale = 1.0 / static_cast<double>(batch.target_count);
  m.zero_grads();
  const double dropped = m.forward_backward(scale).loss;
  std::vector<std::vector<double>> grads;
  for (const auto& p : m.parameters()) grads.push_back(values_of(p->grad()));
  EXPECT_NE(dropped, m.evaluate().loss);
  m.load_batch(batch);
  ScopedCpuThreads one_thread(1);
  const auto objective = [&] { return m.forward_backward(scale).loss * scale; };
  expect_parameter_gradients_match(m, grads, objective);
}

ModelConfig attention_dropout_only() {
  ModelConfig c = dropout_config();
  c.dropout = c.embed_dropout = 0;
  c.attention_dropout = 0.4;
  return c;
}

// The attention probabilities' dropout on its own (so only its masks act): GQA over packed
// documents, a window on one layer and a softcap.
TEST(Dropout, AttentionDropoutGradientMatchesFiniteDifferences) {
  ModelConfig c = attention_dropout_only();
  c.sliding_window = 3;
  c.full_attention_layers = "1";
  c.attention_softcap = 4.0;
  check_dropped_gradients(c, 4242);
}

// The same through an MLA layer (its own site) beside a GQA one.
TEST(Dropout, MlaAttentionDropoutGradientMatchesFiniteDifferences) {
  ModelConfig c = attention_dropout_only();
  c.attention = "mla";
  c.alt_attention = "gqa";
  c.alt_attention_layers = "from:1";
  c.mla.kv_rank = 5;
  c.mla.qk_head_dim = 6;
  c.mla.v_head_dim = 3;
  check_dropped_gradients(c, 4343);
}

// The logits forward (sampling's, the serving prefill's) carries no key: a model with
// every dropout gives the logits of the same weights without any.
TEST(Dropout, LogitsDropNothing) {
  ModelConfig with = dropout_config(), without = dropout_config();
  without.dropout = without.embed_dropout = without.attention_dropout = 0;
  HostBatch batch = pack_docs(three_docs(), 4);
  batch.dropout_key = 5;
  auto logits = [&](const ModelConfig& c) {
    Model m(c, tiny_build());
    m.allocate();
    init_tiny_model(m, 7);
    m.load_batch(batch);
    std::vector<float> out;
    m.logits(0, static_cast<int64_t>(batch.tokens.size()), out);
    return out;
  };
  EXPECT_EQ(logits(with), logits(without));
}

// Without a key the op drops nothing, whatever p; with one it does.
TEST(Dropout, TheAttentionOpDropsOnlyWithAKey) {
  const Shape qs{9, 2, 4};
  const OwnedTensor q = random_tensor(DType::f64, qs, 1), k = random_tensor(DType::f64, qs, 2),
                    v = random_tensor(DType::f64, qs, 3);
  OwnedTensor cu(DType::i32, Device::cpu, Shape{3});
  cu->data<int32_t>()[0] = 0, cu->data<int32_t>()[1] = 4, cu->data<int32_t>()[2] = 9;
  auto run = [&](ops::AttentionOptions o) {
    OwnedTensor out(DType::f64, Device::cpu, qs), lse(DType::f64, Device::cpu, Shape{9, 2});
    ops::attention_forward(process_exec(), *q, *k, *v, *cu, o, *out, *lse);
    return std::make_pair(values_of(*out), values_of(*lse));
  };
  const auto plain = run({});
  ops::AttentionOptions keyless;
  keyless.dropout.p = 0.5;
  EXPECT_EQ(run(keyless), plain);
  const OwnedTensor key = key_tensor(7);
  ops::AttentionOptions keyed = keyless;
  keyed.dropout.key = *key;
  const auto dropped = run(keyed);
  EXPECT_NE(dropped.first, plain.first);
  EXPECT_EQ(dropped.second, plain.second);  // the lse is the undropped softmax's
  keyed.dropout.p = 1.0;
  EXPECT_NE(error_of([&] { run(keyed); }).find("model.attention_dropout (1) must be below 1"), std::string::npos);
}

// transformers' configs carry attention_dropout (applied in training): the export writes
// the configured p.
TEST(Dropout, TheHfConfigCarriesTheAttentionDropout) {
  ModelConfig c = dropout_config();
  c.attention_bias = false;  // qwen3 without biases: a stock class
  BuildOptions o;
  o.training = false;
  o.max_tokens = 4;
  const Model model(c, o);
  EXPECT_EQ(io::hf_config_json(model, io::choose_hf_arch(c), {}, "float32")["attention_dropout"].get<double>(), 0.25);
}

// The gradient of the dropped loss (a fixed key: a fixed mask) against finite differences
// of that same loss, every parameter: the backward applies the forward's masks.
TEST(Dropout, GradientMatchesFiniteDifferencesOfTheDroppedLoss) {
  HostBatch batch = pack_docs(three_docs(), 4);
  batch.dropout_key = 2024;
  Model m(dropout_config(), tiny_build());
  m.allocate();
  init_tiny_model(m, 7);
  m.load_batch(batch);
  const double scale = 1.0 / static_cast<double>(batch.target_count);
  m.zero_grads();
  m.forward_backward(scale);
  std::vector<std::vector<double>> grads;
  for (const auto& p : m.parameters()) grads.push_back(values_of(p->grad()));
  ScopedCpuThreads one_thread(1);
  const auto objective = [&] { return m.forward_backward(scale).loss * scale; };  // its gradients are not read
  expect_parameter_gradients_match(m, grads, objective);
}

TEST(Dropout, ConfigNamesTheKeyAtFault) {
  for (const char* key : {"model.dropout", "model.embed_dropout", "model.attention_dropout"}) {
    Config c;
    apply_override(c, std::string(key) + "=1");
    EXPECT_NE(error_of([&] { validate_config(c); }).find(std::string(key) + " (1) must be below 1"), std::string::npos);
    Config negative;
    EXPECT_NE(error_of([&] { apply_override(negative, std::string(key) + "=-0.1"); validate_config(negative); })
                  .find(key),
              std::string::npos);
  }
}

}  // namespace
}  // namespace kiln

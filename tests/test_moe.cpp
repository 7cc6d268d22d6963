// Mixture of experts on the CPU reference: the dispatch ops against naive loops and finite
// differences, each router against its definition (and its backward against finite
// differences, the choice held fixed), sigmoid_bias's balancing bias, and the sparse MLP
// through a whole model: every parameter's gradient with the balance and z losses on, the
// KV-cache decoder against the full forward, and losses that reach the log.
#include "full_forward.h"
#include "grad_check.h"
#include "infer/decoder.h"
#include "nn/moe/router.h"
#include "ops/moe/moe.h"
#include "ops/moe/routing.h"
#include "test_util.h"
#include "tiny_model.h"

#include <gtest/gtest.h>

#include <map>
#include <numeric>

namespace kiln {
namespace {

using namespace test;

OwnedTensor i32_tensor(const std::vector<int32_t>& v, Shape shape) {
  OwnedTensor t(DType::i32, Device::cpu, shape);
  std::copy(v.begin(), v.end(), t->data<int32_t>());
  return t;
}

OwnedTensor f64_random(Shape shape, uint64_t seed, double scale = 1.0) {
  OwnedTensor t(DType::f64, Device::cpu, shape);
  Rng rng(seed);
  for (int64_t i = 0; i < t->numel(); ++i) t->data<double>()[i] = rng.normal() * scale;
  return t;
}

std::vector<int32_t> ints(const Tensor& t) { return {t.data<int32_t>(), t.data<int32_t>() + t.numel()}; }

struct Dispatch {
  OwnedTensor counts, offsets, pair_of_row, row_of_pair;
  ops::MoeDispatch d;
  Dispatch(int64_t tokens, int64_t k, int64_t experts)
      : counts(DType::i32, Device::cpu, Shape{experts}),
        offsets(DType::i32, Device::cpu, Shape{experts + 1}),
        pair_of_row(DType::i32, Device::cpu, Shape{tokens * k}),
        row_of_pair(DType::i32, Device::cpu, Shape{tokens * k}) {
    d = {experts, k, 0, *counts, *offsets, *pair_of_row, *row_of_pair, Tensor()};
  }
};

TEST(MoeDispatch, GroupsPairsByExpertStably) {
  // Tokens 0..2, top 2 of 4: pairs p = 2t + j.
  const OwnedTensor experts = i32_tensor({1, 3, 1, 0, 2, 1}, Shape{3, 2});
  Dispatch disp(3, 2, 4);
  ops::moe_dispatch(process_exec(), *experts, disp.d);
  EXPECT_EQ(ints(*disp.counts), (std::vector<int32_t>{1, 3, 1, 1}));
  EXPECT_EQ(ints(*disp.offsets), (std::vector<int32_t>{0, 1, 4, 5, 6}));
  EXPECT_EQ(ints(*disp.pair_of_row), (std::vector<int32_t>{3, 0, 2, 5, 4, 1}));  // expert 1: pairs 0, 2, 5 in order
  for (int32_t p = 0; p < 6; ++p) EXPECT_EQ(disp.pair_of_row->data<int32_t>()[disp.row_of_pair->data<int32_t>()[p]], p);
  const OwnedTensor bad = i32_tensor({1, 4, 0, 0, 0, 0}, Shape{3, 2});
  EXPECT_THROW(ops::moe_dispatch(process_exec(), *bad, disp.d), Error);
}

// gather -> grouped linear -> combine equals, per token, sum_j w_j W_{e_j} x; and the
// backward of that chain matches finite differences in x, W and the weights. Expert 3 gets
// no tokens and expert 0 most of them.
TEST(MoeOps, ChainMatchesNaiveAndFiniteDifferences) {
  const int64_t t_count = 5, k = 2, e_count = 4, in = 3, out = 2;
  const OwnedTensor experts = i32_tensor({0, 1, 0, 2, 1, 0, 0, 2, 2, 0}, Shape{t_count, k});
  Dispatch disp(t_count, k, e_count);
  ops::moe_dispatch(process_exec(), *experts, disp.d);
  OwnedTensor x = f64_random(Shape{t_count, in}, 1), w = f64_random(Shape{e_count * out, in}, 2);
  OwnedTensor weights = f64_random(Shape{t_count, k}, 3);
  OwnedTensor grouped(DType::f64, Device::cpu, Shape{t_count * k, in}), y(DType::f64, Device::cpu, Shape{t_count * k, out});
  OwnedTensor result(DType::f64, Device::cpu, Shape{t_count, out});
  auto run = [&] {
    ops::moe_gather(process_exec(), *x, disp.d, *grouped);
    ops::moe_grouped_linear_forward(process_exec(), *grouped, *w, disp.d, *y);
    ops::moe_combine(process_exec(), *y, *weights, disp.d, *result);
  };
  run();
  for (int64_t t = 0; t < t_count; ++t)
    for (int64_t o = 0; o < out; ++o) {
      double want = 0;
      for (int64_t j = 0; j < k; ++j) {
        const int32_t e = experts->data<int32_t>()[t * k + j];
        double dot = 0;
        for (int64_t i = 0; i < in; ++i) dot += w->data<double>()[(e * out + o) * in + i] * x->data<double>()[t * in + i];
        want += weights->data<double>()[t * k + j] * dot;
      }
      EXPECT_NEAR(result->data<double>()[t * out + o], want, 1e-14) << t << "," << o;
    }
  // Backward of L = sum(result * g).
  const OwnedTensor g = f64_random(Shape{t_count, out}, 4);
  OwnedTensor dy(DType::f64, Device::cpu, y->shape()), dweights(DType::f64, Device::cpu, weights->shape());
  OwnedTensor dgrouped(DType::f64, Device::cpu, grouped->shape()), dx(DType::f64, Device::cpu, x->shape());
  OwnedTensor dw(DType::f64, Device::cpu, w->shape());
  zero_tensor(*dw);
  ops::moe_combine_backward(process_exec(), *y, *weights, *g, disp.d, *dy, *dweights);
  ops::moe_grouped_linear_backward(process_exec(), *grouped, *w, *dy, disp.d, *dgrouped, *dw);
  ops::moe_gather_backward(process_exec(), *dgrouped, disp.d, *dx, false);
  auto objective = [&] {
    run();
    double l = 0;
    for (int64_t i = 0; i < result->numel(); ++i) l += result->data<double>()[i] * g->data<double>()[i];
    return l;
  };
  for (auto [tensor, grad] : {std::pair{&x, &dx}, std::pair{&w, &dw}, std::pair{&weights, &dweights}}) {
    const GradCheckReport r = check_gradient_scalar(**tensor, values_of(**grad), objective);
    EXPECT_TRUE(r.ok()) << r.str();
  }
  // Expert 3's weight rows got no gradient: no token went there.
  for (int64_t i = 3 * out * in; i < 4 * out * in; ++i) EXPECT_EQ(dw->data<double>()[i], 0.0);
}

TEST(Routers, SoftmaxTopKFollowsItsDefinition) {
  const int64_t t_count = 6, e_count = 5, k = 2;
  const OwnedTensor logits = f64_random(Shape{t_count, e_count}, 7);
  for (bool normalize : {true, false}) {
    SCOPED_TRACE(normalize ? "norm_topk_prob" : "raw");
    OwnedTensor probs(DType::f64, Device::cpu, logits->shape()), ids(DType::i32, Device::cpu, Shape{t_count, k});
    OwnedTensor weights(DType::f64, Device::cpu, Shape{t_count, k});
    const ops::Routes routes{*ids, *weights};
    ops::softmax_topk_forward(process_exec(), *logits, normalize, *probs, routes);
    for (int64_t t = 0; t < t_count; ++t) {
      const double* l = logits->data<double>() + t * e_count;
      double sum = 0;
      for (int64_t j = 0; j < e_count; ++j) sum += std::exp(l[j]);
      std::vector<int32_t> order(static_cast<size_t>(e_count));
      std::iota(order.begin(), order.end(), 0);
      std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return l[a] > l[b]; });
      const double chosen = (std::exp(l[order[0]]) + std::exp(l[order[1]])) / sum;
      for (int64_t j = 0; j < k; ++j) {
        EXPECT_EQ(ids->data<int32_t>()[t * k + j], order[static_cast<size_t>(j)]);
        const double p = std::exp(l[order[static_cast<size_t>(j)]]) / sum;
        EXPECT_NEAR(weights->data<double>()[t * k + j], normalize ? p / chosen : p, 1e-15);
      }
    }
    // Backward: L = sum(weights * a) + sum(probs * b) against finite differences in the logits.
    const OwnedTensor a = f64_random(Shape{t_count, k}, 8), b = f64_random(Shape{t_count, e_count}, 9);
    OwnedTensor dlogits(DType::f64, Device::cpu, logits->shape());
    ops::softmax_topk_backward(process_exec(), *probs, routes, normalize, *a, *b, *dlogits);
    auto objective = [&] {
      ops::softmax_topk_forward(process_exec(), *logits, normalize, *probs, routes);
      double l = 0;
      for (int64_t i = 0; i < weights->numel(); ++i) l += weights->data<double>()[i] * a->data<double>()[i];
      for (int64_t i = 0; i < probs->numel(); ++i) l += probs->data<double>()[i] * b->data<double>()[i];
      return l;
    };
    const GradCheckReport r = check_gradient_scalar(*logits, values_of(*dlogits), objective);
    EXPECT_TRUE(r.ok()) << r.str();
  }
}

// The choice follows score + bias, the weights the scores alone; a group limit keeps the
// choice inside the best groups.
TEST(Routers, SigmoidBiasChoosesOnScorePlusBiasAndWeighsOnTheScore) {
  OwnedTensor l(DType::f64, Device::cpu, Shape{1, 4}), bias(DType::f64, Device::cpu, Shape{4});
  const double values[4] = {2.0, 1.0, 0.5, -1.0};
  std::copy(values, values + 4, l->data<double>());
  const double b[4] = {0.0, 0.0, 0.5, 0.0};  // lifts expert 2 above expert 1
  std::copy(b, b + 4, bias->data<double>());
  OwnedTensor scores(DType::f64, Device::cpu, l->shape()), ids(DType::i32, Device::cpu, Shape{1, 2});
  OwnedTensor weights(DType::f64, Device::cpu, Shape{1, 2});
  const ops::Routes routes{*ids, *weights};
  auto sig = [](double x) { return 1.0 / (1.0 + std::exp(-x)); };
  ops::sigmoid_bias_forward(process_exec(), *l, *bias, 1, 1, true, 2.5, *scores, routes);
  EXPECT_EQ(ints(*ids), (std::vector<int32_t>{2, 0}));  // keys: s2 + 0.5 = 1.12 > s0 = 0.88 > s1 = 0.73
  const double s0 = sig(2.0), s2 = sig(0.5);
  EXPECT_NEAR(weights->data<double>()[0], 2.5 * s2 / (s0 + s2), 1e-15);
  EXPECT_NEAR(weights->data<double>()[1], 2.5 * s0 / (s0 + s2), 1e-15);
  // Two groups {0, 1} and {2, 3}: group scores (s0 + s1) and (s2 + b2 + s3); with one group
  // allowed, both choices come from the first.
  ops::sigmoid_bias_forward(process_exec(), *l, *bias, 2, 1, false, 1.0, *scores, routes);
  EXPECT_EQ(ints(*ids), (std::vector<int32_t>{0, 1}));
  EXPECT_NEAR(weights->data<double>()[1], sig(1.0), 1e-15);
  // Backward against finite differences (random logits, groups on, both normalizations).
  const OwnedTensor big = f64_random(Shape{6, 8}, 11);
  OwnedTensor b8 = f64_random(Shape{8}, 12, 0.1), s8(DType::f64, Device::cpu, Shape{6, 8});
  OwnedTensor i8(DType::i32, Device::cpu, Shape{6, 3}), w8(DType::f64, Device::cpu, Shape{6, 3});
  const ops::Routes r8{*i8, *w8};
  for (bool normalize : {true, false}) {
    ops::sigmoid_bias_forward(process_exec(), *big, *b8, 4, 2, normalize, 1.5, *s8, r8);
    const OwnedTensor a = f64_random(Shape{6, 3}, 13), c = f64_random(Shape{6, 8}, 14);
    OwnedTensor dlogits(DType::f64, Device::cpu, big->shape());
    ops::sigmoid_bias_backward(process_exec(), *s8, r8, normalize, 1.5, *a, *c, *dlogits);
    auto objective = [&] {
      ops::sigmoid_bias_forward(process_exec(), *big, *b8, 4, 2, normalize, 1.5, *s8, r8);
      double v = 0;
      for (int64_t i = 0; i < w8->numel(); ++i) v += w8->data<double>()[i] * a->data<double>()[i];
      for (int64_t i = 0; i < s8->numel(); ++i) v += s8->data<double>()[i] * c->data<double>()[i];
      return v;
    };
    const GradCheckReport r = check_gradient_scalar(*big, values_of(*dlogits), objective);
    EXPECT_TRUE(r.ok()) << r.str();
  }
}

TEST(Routers, BalanceAndZLossesFollowTheirDefinitions) {
  const int64_t t_count = 4, e_count = 3;
  OwnedTensor logits = f64_random(Shape{t_count, e_count}, 21);
  OwnedTensor probs(DType::f64, Device::cpu, logits->shape());
  for (int64_t t = 0; t < t_count; ++t) {
    double sum = 0;
    for (int64_t j = 0; j < e_count; ++j) sum += std::exp(logits->data<double>()[t * e_count + j]);
    for (int64_t j = 0; j < e_count; ++j)
      probs->data<double>()[t * e_count + j] = std::exp(logits->data<double>()[t * e_count + j]) / sum;
  }
  const OwnedTensor counts = i32_tensor({5, 2, 1}, Shape{3});  // of 4 tokens x top 2
  double want = 0;
  for (int64_t j = 0; j < e_count; ++j) {
    double p = 0;
    for (int64_t t = 0; t < t_count; ++t) p += probs->data<double>()[t * e_count + j];
    want += 3.0 * (counts->data<int32_t>()[j] / 8.0) * (p / 4.0);
  }
  OwnedTensor dprobs(DType::f64, Device::cpu, probs->shape());
  zero_tensor(*dprobs);
  EXPECT_NEAR(ops::balance_loss(process_exec(), *probs, *counts, 2, 0.5, *dprobs), want, 1e-15);
  const GradCheckReport r = check_gradient_scalar(
      *probs, values_of(*dprobs), [&] { return 0.5 * ops::balance_loss(process_exec(), *probs, *counts, 2, 0, Tensor()); });
  EXPECT_TRUE(r.ok()) << r.str();
  // Perfectly balanced routing with uniform probabilities: the loss is exactly 1.
  OwnedTensor uniform(DType::f64, Device::cpu, Shape{3, 3});
  for (int64_t i = 0; i < 9; ++i) uniform->data<double>()[i] = 1.0 / 3.0;
  EXPECT_NEAR(ops::balance_loss(process_exec(), *uniform, *i32_tensor({2, 2, 2}, Shape{3}), 2, 0, Tensor()), 1.0, 1e-15);
  // z-loss: mean lse^2 and its gradient.
  OwnedTensor dlogits(DType::f64, Device::cpu, logits->shape());
  zero_tensor(*dlogits);
  double z = 0;
  for (int64_t t = 0; t < t_count; ++t) {
    double sum = 0;
    for (int64_t j = 0; j < e_count; ++j) sum += std::exp(logits->data<double>()[t * e_count + j]);
    z += std::log(sum) * std::log(sum) / t_count;
  }
  EXPECT_NEAR(ops::router_z_loss(process_exec(), *logits, 2.0, *dlogits), z, 1e-14);
  const GradCheckReport rz =
      check_gradient_scalar(*logits, values_of(*dlogits), [&] { return 2.0 * ops::router_z_loss(process_exec(), *logits, 0, Tensor()); });
  EXPECT_TRUE(rz.ok()) << rz.str();
}

ModelConfig moe_config(const std::string& router, int64_t shared) {
  ModelConfig c = tiny_config(true, false);  // 2 layers of hidden 8
  c.mlp = "moe";
  c.moe.experts = 4;
  c.moe.top_k = 2;
  c.moe.expert_hidden = 6;
  c.moe.shared_hidden = shared;
  c.moe.router = router;
  c.moe.aux_loss = 0.05;
  c.moe.z_loss = 0.01;
  c.moe.routed_scaling = router == "sigmoid_bias" ? 1.5 : 1.0;
  return c;
}

// Every parameter of a model with a sparse MLP against 4th-order finite differences of
// its objective: the LM head's loss plus the routers' balance and z losses (one
// micro-batch: their per-micro-batch scale is 1). The routing choice is held fixed by the
// derivative; steps of 1e-4 keep it fixed on this model (a tie flipping would show as one
// failing element).
void check_moe_gradient(const ModelConfig& config) {
  const HostBatch batch = pack_docs(three_docs(), 4);
  Model m(config, tiny_build());
  m.allocate();
  init_tiny_model(m, 5);
  m.load_batch(batch);
  const double scale = 1.0 / static_cast<double>(batch.target_count);
  const LossTerms& terms = m.loss_terms();
  const int aux = terms.find("moe_aux"), z = terms.find("moe_z");
  ASSERT_GE(aux, 0);
  ASSERT_GE(z, 0);
  m.zero_grads();
  const LossSums fb = m.forward_backward(scale);
  EXPECT_GT(fb.slot[static_cast<size_t>(aux)], 0.0);
  EXPECT_GT(fb.slot[static_cast<size_t>(z)], 0.0);
  const auto objective = [&] {
    const LossSums s = m.evaluate();
    return s.loss * scale + config.moe.aux_loss * s.slot[static_cast<size_t>(aux)] +
           config.moe.z_loss * s.slot[static_cast<size_t>(z)];
  };
  const GradCheckOptions o = model_grad_check_options();
  int64_t checked = 0;
  for (const auto& p : m.parameters()) {
    if (!p->trainable()) continue;
    const GradCheckReport r = check_gradient_scalar(p->value(), values_of(p->grad()), objective, o);
    EXPECT_TRUE(r.ok()) << p->name() << ": " << r.str();
    checked += r.checked;
  }
  EXPECT_GT(checked, 0);
}

TEST(MoeModel, SoftmaxTopKModelMatchesFiniteDifferences) { check_moe_gradient(moe_config("softmax_topk", 0)); }

TEST(MoeModel, SigmoidBiasModelWithSharedExpertMatchesFiniteDifferences) {
  check_moe_gradient(moe_config("sigmoid_bias", 5));
}

// model.moe.save_outputs = true: the routing weights' gradient from the saved output rows
// (the default, false, forms it from the activations: the tests above).
TEST(MoeModel, SavedOutputsModelMatchesFiniteDifferences) {
  ModelConfig c = moe_config("sigmoid_bias", 5);
  c.moe.save_outputs = true;
  check_moe_gradient(c);
}

// Layer 0 dense (the alternative MLP), layer 1 sparse: the names and parameter counts
// show where each went; an expert counts k/E of itself as active.
TEST(MoeModel, LayerPatternsPlaceTheSparseLayersAndActiveCountsWeighExperts) {
  ModelConfig c = moe_config("softmax_topk", 0);
  c.alt_mlp = "swiglu";
  c.alt_mlp_layers = "first:1";
  Model m(c, tiny_build());
  EXPECT_NE(m.find_parameter("layers.0.mlp.gate_proj.weight"), nullptr);
  EXPECT_EQ(m.find_parameter("layers.0.mlp.gate.weight"), nullptr);
  const Parameter* expert = m.find_parameter("layers.1.mlp.experts.3.down_proj.weight");
  ASSERT_NE(expert, nullptr);
  EXPECT_EQ(expert->names().hf, "model.layers.1.mlp.experts.3.down_proj.weight");
  EXPECT_EQ(expert->names().gguf, "blk.1.ffn_down_exps.weight");
  EXPECT_EQ(expert->names().gguf_stack, 3);
  const int64_t expert_params = 4 * 3 * 6 * 8;  // 4 experts x (gate, up, down) x 6 x 8
  EXPECT_NEAR(static_cast<double>(m.parameter_count()) - m.active_parameter_count(), expert_params * 0.5, 1e-9);
}

// sigmoid_bias's bias moves after each applied step towards the mean load, is saved with
// the model, and moves nothing after a skipped step.
TEST(MoeModel, SigmoidBiasUpdatesFromTheStepsLoad) {
  for (const char* rule : {"sign", "proportional"}) {
    SCOPED_TRACE(rule);
    ModelConfig c = moe_config("sigmoid_bias", 0);
    c.moe.bias_update = rule;
    c.moe.bias_rate = 0.01;
    Model m(c, tiny_build());
    m.allocate();
    init_tiny_model(m, 5);
    const Parameter* bias = m.find_parameter("layers.0.mlp.gate.e_score_correction_bias");
    ASSERT_NE(bias, nullptr);
    EXPECT_FALSE(bias->trainable());
    const std::vector<double> before = values_of(bias->value());
    m.load_batch(pack_docs(three_docs(), 4));
    m.zero_grads();
    m.forward_backward(1.0);
    m.after_step(false);  // skipped: the load is dropped, the bias stays
    EXPECT_EQ(values_of(bias->value()), before);
    m.forward_backward(1.0);
    m.after_step(true);
    const std::vector<double> after = values_of(bias->value());
    double moved = 0, total = 0;
    for (size_t i = 0; i < after.size(); ++i) moved += std::abs(after[i] - before[i]), total += after[i] - before[i];
    EXPECT_GT(moved, 0.0);
    // The sign rule moves each bias by exactly +-rate or 0; the proportional rule's steps sum
    // to zero (the load's deviations from the mean do).
    if (std::string(rule) == "sign")
      for (size_t i = 0; i < after.size(); ++i)
        EXPECT_TRUE(std::abs(std::abs(after[i] - before[i]) - 0.01) < 1e-12 || after[i] == before[i]) << i;
    else
      EXPECT_NEAR(total, 0.0, 1e-12);
  }
}

// The KV-cache decoder runs the sparse MLP over its rows: every row's logits equal the full
// forward over the prefix (f64: to rounding), prefill and decode steps alike.
TEST(MoeModel, DecoderMatchesTheFullForward) {
  ModelConfig c = moe_config("sigmoid_bias", 5);
  c.vocab_size = 13;
  BuildOptions o = tiny_build(16);
  o.training = false;
  Model model(c, o);
  model.allocate();
  init_tiny_model(model, 9);
  DecoderOptions d;
  d.slots = 2;
  d.max_rows = 4;
  d.logit_rows = 4;
  Decoder decoder(model, d);
  const std::vector<std::vector<int32_t>> seqs = {{1, 5, 7, 2, 9, 3}, {4, 4, 11, 6}};
  // Both in lockstep (the shorter drops out), every row against the full forward.
  const double worst = lockstep_decode_error(model, decoder, seqs);
  EXPECT_LT(worst, 1e-6);  // f64 math, logits returned as f32 (scaled by the largest logit)
}

}  // namespace
}  // namespace kiln

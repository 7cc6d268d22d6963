// The routers beyond the top-k ones, and the dispatch's empty slots and capacity, on the
// CPU reference: sinkhorn, expert_choice and relu each against its definition, their
// backwards against finite differences (the choice held fixed), relu's adaptive L1
// coefficient, the capacity's drops; and through a whole model: gradients, the decoder
// against the full (evaluation) forward, the refusals of expert_choice, the drops reported.
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

OwnedTensor f64_zeros(Shape shape) {
  OwnedTensor t(DType::f64, Device::cpu, shape);
  zero_tensor(*t);
  return t;
}

std::vector<int32_t> ints(const Tensor& t) { return {t.data<int32_t>(), t.data<int32_t>() + t.numel()}; }

double dot(const Tensor& a, const Tensor& b) {
  double s = 0;
  for (int64_t i = 0; i < a.numel(); ++i) s += a.data<double>()[i] * b.data<double>()[i];
  return s;
}

struct Dispatch {
  OwnedTensor counts, offsets, pair_of_row, row_of_pair, dropped;
  ops::MoeDispatch d;
  Dispatch(int64_t tokens, int64_t k, int64_t experts, int64_t rows, int64_t capacity)
      : counts(DType::i32, Device::cpu, Shape{experts}),
        offsets(DType::i32, Device::cpu, Shape{experts + 1}),
        pair_of_row(DType::i32, Device::cpu, Shape{rows}),
        row_of_pair(DType::i32, Device::cpu, Shape{tokens * k}),
        dropped(DType::i32, Device::cpu, Shape{1}) {
    dropped->data<int32_t>()[0] = 0;
    d = {experts, k, capacity, *counts, *offsets, *pair_of_row, *row_of_pair, *dropped};
  }
};

// Empty slots (-1) take no row; with a capacity of 2 an expert keeps its first two pairs in
// pair order, and the others are dropped and counted.
TEST(MoeDispatch, EmptySlotsTakeNoRowAndTheCapacityDropsByPosition) {
  // 4 tokens x 2 slots over 3 experts: pairs 0..7.
  const OwnedTensor experts = i32_tensor({1, -1, 1, 0, 1, 2, -1, 1}, Shape{4, 2});
  Dispatch disp(4, 2, 3, 6, 2);
  ops::moe_dispatch(process_exec(), *experts, disp.d);
  EXPECT_EQ(ints(*disp.counts), (std::vector<int32_t>{1, 4, 1}));   // routed, before the drop
  EXPECT_EQ(ints(*disp.offsets), (std::vector<int32_t>{0, 1, 3, 4}));  // kept: 1, 2, 1
  EXPECT_EQ(ints(*disp.row_of_pair), (std::vector<int32_t>{1, -1, 2, 0, -1, 3, -1, -1}));
  EXPECT_EQ(std::vector<int32_t>(disp.pair_of_row->data<int32_t>(), disp.pair_of_row->data<int32_t>() + 4),
            (std::vector<int32_t>{3, 0, 2, 5}));
  EXPECT_EQ(disp.dropped->data<int32_t>()[0], 2);  // expert 1's pairs 4 and 7
  // Without the capacity every routed pair is kept; more live rows than the layout holds is an error.
  Dispatch all(4, 2, 3, 6, 0);
  ops::moe_dispatch(process_exec(), *experts, all.d);
  EXPECT_EQ(ints(*all.offsets), (std::vector<int32_t>{0, 1, 5, 6}));
  EXPECT_EQ(all.dropped->data<int32_t>()[0], 0);
  Dispatch small(4, 2, 3, 5, 0);
  EXPECT_THROW(ops::moe_dispatch(process_exec(), *experts, small.d), Error);
}

// gather -> grouped linear -> combine with empty and dropped pairs: they contribute nothing
// (the naive sum skips them), the unused grouped rows are zero, and the backward matches
// finite differences (a dropped pair's weight gets no gradient).
TEST(MoeOps, EmptyAndDroppedPairsContributeNothing) {
  const int64_t t_count = 5, k = 2, e_count = 3, in = 3, out = 2, rows = 7, capacity = 2;
  const OwnedTensor experts = i32_tensor({0, 1, 0, -1, 0, 2, 1, 0, -1, 2}, Shape{t_count, k});
  Dispatch disp(t_count, k, e_count, rows, capacity);
  ops::moe_dispatch(process_exec(), *experts, disp.d);
  ASSERT_EQ(disp.dropped->data<int32_t>()[0], 2);  // expert 0's pairs 4 and 7
  OwnedTensor x = f64_random(Shape{t_count, in}, 1), w = f64_random(Shape{e_count * out, in}, 2);
  OwnedTensor weights = f64_random(Shape{t_count, k}, 3);
  OwnedTensor grouped = f64_zeros(Shape{rows, in}), y = f64_zeros(Shape{rows, out}), result = f64_zeros(Shape{t_count, out});
  for (int64_t i = 0; i < grouped->numel(); ++i) grouped->data<double>()[i] = 7.0;  // gather must zero the unused rows
  auto run = [&] {
    ops::moe_gather(process_exec(), *x, disp.d, *grouped);
    ops::moe_grouped_linear_forward(process_exec(), *grouped, *w, disp.d, *y);
    ops::moe_combine(process_exec(), *y, *weights, disp.d, *result);
  };
  run();
  for (int64_t r = 6; r < rows; ++r)  // 6 rows kept
    for (int64_t i = 0; i < in; ++i) EXPECT_EQ(grouped->data<double>()[r * in + i], 0.0);
  const std::vector<bool> kept = {true, true, true, false, false, true, true, false, false, true};
  for (int64_t t = 0; t < t_count; ++t)
    for (int64_t o = 0; o < out; ++o) {
      double want = 0;
      for (int64_t j = 0; j < k; ++j) {
        if (!kept[static_cast<size_t>(t * k + j)]) continue;
        const int32_t e = experts->data<int32_t>()[t * k + j];
        double s = 0;
        for (int64_t i = 0; i < in; ++i) s += w->data<double>()[(e * out + o) * in + i] * x->data<double>()[t * in + i];
        want += weights->data<double>()[t * k + j] * s;
      }
      EXPECT_NEAR(result->data<double>()[t * out + o], want, 1e-14) << t << "," << o;
    }
  const OwnedTensor g = f64_random(Shape{t_count, out}, 4);
  OwnedTensor dy = f64_zeros(y->shape()), dweights = f64_random(weights->shape(), 5);  // junk: must be overwritten
  OwnedTensor dgrouped = f64_zeros(grouped->shape()), dx = f64_zeros(x->shape()), dw = f64_zeros(w->shape());
  ops::moe_combine_backward(process_exec(), *y, *weights, *g, disp.d, *dy, *dweights);
  ops::moe_grouped_linear_backward(process_exec(), *grouped, *w, *dy, disp.d, *dgrouped, *dw);
  ops::moe_gather_backward(process_exec(), *dgrouped, disp.d, *dx, false);
  for (size_t p = 0; p < kept.size(); ++p)
    if (!kept[p]) EXPECT_EQ(dweights->data<double>()[p], 0.0) << p;
  auto objective = [&] {
    run();
    return dot(*result, *g);
  };
  for (auto [tensor, grad] : {std::pair{&x, &dx}, std::pair{&w, &dw}, std::pair{&weights, &dweights}}) {
    const GradCheckReport r = check_gradient_scalar(**tensor, values_of(**grad), objective);
    EXPECT_TRUE(r.ok()) << r.str();
  }
}

std::vector<double> softmax_row(const double* l, int64_t n) {
  const double m = *std::max_element(l, l + n);
  std::vector<double> p(static_cast<size_t>(n));
  double sum = 0;
  for (int64_t j = 0; j < n; ++j) sum += p[static_cast<size_t>(j)] = std::exp(l[j] - m);
  for (double& v : p) v /= sum;
  return p;
}

// Every token prefers expert 0: the softmax's top k sends them all there; the top k of
// Sinkhorn's balanced matrix (rows summing to 1/T, columns to 1/E: a fractional balanced
// assignment) spreads them near evenly; the weights stay the softmax's. No iteration is
// softmax_topk exactly.
TEST(Routers, SinkhornBalancesTheChoiceAndWeighsOnTheSoftmax) {
  const int64_t t_count = 12, e_count = 4;
  OwnedTensor logits = f64_random(Shape{t_count, e_count}, 31, 0.3);
  for (int64_t t = 0; t < t_count; ++t) logits->data<double>()[t * e_count] += 2.0;
  OwnedTensor probs = f64_zeros(logits->shape()), rows = f64_zeros(Shape{t_count}), cols = f64_zeros(Shape{e_count});
  for (int64_t k : {1, 2}) {
    SCOPED_TRACE(k);
    OwnedTensor ids(DType::i32, Device::cpu, Shape{t_count, k}), weights = f64_zeros(Shape{t_count, k});
    const ops::Routes routes{*ids, *weights};
    ops::sinkhorn_topk_forward(process_exec(), *logits, 50, true, *probs, *rows, *cols, routes);
    auto max_load = [&](const Tensor& chosen) {
      std::vector<int> load(static_cast<size_t>(e_count), 0);
      for (int32_t e : ints(chosen)) ++load[static_cast<size_t>(e)];
      return *std::max_element(load.begin(), load.end());
    };
    const double mean = static_cast<double>(t_count * k) / static_cast<double>(e_count);
    EXPECT_LE(max_load(*ids), 1.5 * mean);
    {
      OwnedTensor plain(DType::i32, Device::cpu, Shape{t_count, k}), plain_w = f64_zeros(Shape{t_count, k});
      ops::softmax_topk_forward(process_exec(), *logits, true, *probs, {*plain, *plain_w});
      EXPECT_GE(max_load(*plain), 2.0 * mean);  // the imbalance it corrects
    }
    for (int64_t e = 0; e < e_count; ++e) {
      double col = 0;
      for (int64_t t = 0; t < t_count; ++t)
        col += rows->data<double>()[t] * cols->data<double>()[e] * probs->data<double>()[t * e_count + e];
      EXPECT_NEAR(col, 1.0 / e_count, 1e-6) << e;
    }
    for (int64_t t = 0; t < t_count; ++t) {
      const std::vector<double> p = softmax_row(logits->data<double>() + t * e_count, e_count);
      double chosen = 0;
      for (int64_t j = 0; j < k; ++j) chosen += p[static_cast<size_t>(ids->data<int32_t>()[t * k + j])];
      for (int64_t j = 0; j < k; ++j)
        EXPECT_NEAR(weights->data<double>()[t * k + j], p[static_cast<size_t>(ids->data<int32_t>()[t * k + j])] / chosen,
                    1e-15);
    }
    // Zero iterations: the softmax's own top k.
    OwnedTensor ids0(DType::i32, Device::cpu, Shape{t_count, k}), weights0 = f64_zeros(Shape{t_count, k});
    OwnedTensor ids1(DType::i32, Device::cpu, Shape{t_count, k}), weights1 = f64_zeros(Shape{t_count, k});
    ops::sinkhorn_topk_forward(process_exec(), *logits, 0, true, *probs, *rows, *cols, {*ids0, *weights0});
    ops::softmax_topk_forward(process_exec(), *logits, true, *probs, {*ids1, *weights1});
    EXPECT_EQ(ints(*ids0), ints(*ids1));
    EXPECT_EQ(values_of(*weights0), values_of(*weights1));
    // Backward (softmax_topk's) against finite differences of the Sinkhorn-routed forward.
    for (bool normalize : {true, false}) {
      ops::sinkhorn_topk_forward(process_exec(), *logits, 5, normalize, *probs, *rows, *cols, routes);
      const OwnedTensor a = f64_random(Shape{t_count, k}, 32), b = f64_random(Shape{t_count, e_count}, 33);
      OwnedTensor dlogits = f64_zeros(logits->shape());
      ops::softmax_topk_backward(process_exec(), *probs, routes, normalize, *a, *b, *dlogits);
      const GradCheckReport r = check_gradient_scalar(*logits, values_of(*dlogits), [&] {
        ops::sinkhorn_topk_forward(process_exec(), *logits, 5, normalize, *probs, *rows, *cols, routes);
        return dot(*weights, *a) + dot(*probs, *b);
      });
      EXPECT_TRUE(r.ok()) << r.str();
    }
  }
}

// Each expert takes exactly C tokens, the ones scoring it highest, weighted by their softmax
// score; a token may get none or several; backward against finite differences.
TEST(Routers, ExpertChoiceGivesEachExpertItsTopTokens) {
  const int64_t t_count = 9, e_count = 4, capacity = 3;
  OwnedTensor logits = f64_random(Shape{t_count, e_count}, 41, 1.5);
  OwnedTensor probs = f64_zeros(logits->shape()), ids(DType::i32, Device::cpu, Shape{t_count, e_count});
  OwnedTensor weights = f64_zeros(Shape{t_count, e_count});
  const ops::Routes routes{*ids, *weights};
  ops::expert_choice_forward(process_exec(), *logits, capacity, *probs, routes);
  std::vector<int> per_token(static_cast<size_t>(t_count), 0);
  for (int64_t e = 0; e < e_count; ++e) {
    std::vector<std::pair<double, int64_t>> column;
    for (int64_t t = 0; t < t_count; ++t)
      column.push_back({softmax_row(logits->data<double>() + t * e_count, e_count)[static_cast<size_t>(e)], t});
    std::sort(column.begin(), column.end(), [](auto a, auto b) { return a.first > b.first; });
    for (int64_t i = 0; i < t_count; ++i) {
      const int64_t t = column[static_cast<size_t>(i)].second;
      const bool taken = i < capacity;
      EXPECT_EQ(ids->data<int32_t>()[t * e_count + e], taken ? e : -1) << t << "," << e;
      EXPECT_NEAR(weights->data<double>()[t * e_count + e], taken ? column[static_cast<size_t>(i)].first : 0.0, 1e-15);
      per_token[static_cast<size_t>(t)] += taken;
    }
  }
  EXPECT_EQ(std::accumulate(per_token.begin(), per_token.end(), 0), e_count * capacity);
  const OwnedTensor a = f64_random(Shape{t_count, e_count}, 42), b = f64_random(Shape{t_count, e_count}, 43);
  OwnedTensor dlogits = f64_zeros(logits->shape());
  ops::softmax_topk_backward(process_exec(), *probs, routes, false, *a, *b, *dlogits);
  const GradCheckReport r = check_gradient_scalar(*logits, values_of(*dlogits), [&] {
    ops::expert_choice_forward(process_exec(), *logits, capacity, *probs, routes);
    return dot(*weights, *a) + dot(*probs, *b);
  });
  EXPECT_TRUE(r.ok()) << r.str();
}

// ReLU gates route each token to its positive experts with the gate as weight; the backward
// (weights and the L1 penalty coef x scale x mean_t sum_e gate) against finite differences;
// the coefficient grows while too many gates are on and shrinks when too few are.
TEST(Routers, ReluRoutesEveryPositiveGateWithAnAdaptiveL1) {
  const int64_t t_count = 6, e_count = 5;
  OwnedTensor logits = f64_random(Shape{t_count, e_count}, 51);
  OwnedTensor probs = f64_zeros(logits->shape()), ids(DType::i32, Device::cpu, Shape{t_count, e_count});
  OwnedTensor weights = f64_zeros(Shape{t_count, e_count}), coef(DType::f64, Device::cpu, Shape{1});
  coef->data<double>()[0] = 0.3;
  const ops::Routes routes{*ids, *weights};
  ops::relu_route_forward(process_exec(), *logits, *probs, routes);
  double l1 = 0;
  for (int64_t t = 0; t < t_count; ++t) {
    double sum = 0;
    for (int64_t e = 0; e < e_count; ++e) sum += std::max(0.0, logits->data<double>()[t * e_count + e]);
    l1 += sum / t_count;
    for (int64_t e = 0; e < e_count; ++e) {
      const double l = logits->data<double>()[t * e_count + e];
      EXPECT_EQ(ids->data<int32_t>()[t * e_count + e], l > 0 ? e : -1);
      EXPECT_EQ(weights->data<double>()[t * e_count + e], l > 0 ? l : 0.0);
      EXPECT_NEAR(probs->data<double>()[t * e_count + e], l > 0 ? l / sum : 0.0, 1e-15);
    }
  }
  EXPECT_NEAR(ops::relu_l1(process_exec(), *logits), l1, 1e-14);
  const double scale = 0.5;
  const OwnedTensor a = f64_random(Shape{t_count, e_count}, 52);
  OwnedTensor dlogits = f64_zeros(logits->shape());
  ops::relu_route_backward(process_exec(), routes, *a, *coef, scale, *dlogits);
  const GradCheckReport r = check_gradient_scalar(*logits, values_of(*dlogits), [&] {
    ops::relu_route_forward(process_exec(), *logits, *probs, routes);
    return dot(*weights, *a) + 0.3 * scale * ops::relu_l1(process_exec(), *logits);
  });
  EXPECT_TRUE(r.ok()) << r.str();
  // Target 1 of 4 experts (sparsity 0.75) over 10 tokens: 20 pairs is sparsity 0.5 (too
  // dense: x 1.2), 5 pairs 0.875 (too sparse: / 1.2); no tokens: unchanged.
  OwnedTensor tokens(DType::f64, Device::cpu, Shape{1});
  tokens->data<double>()[0] = 10;
  ops::relu_l1_update(process_exec(), *coef, *i32_tensor({8, 4, 4, 4}, Shape{4}), *tokens, 1, 1.2);
  EXPECT_NEAR(coef->data<double>()[0], 0.36, 1e-15);
  ops::relu_l1_update(process_exec(), *coef, *i32_tensor({2, 1, 1, 1}, Shape{4}), *tokens, 1, 1.2);
  EXPECT_NEAR(coef->data<double>()[0], 0.3, 1e-15);
  tokens->data<double>()[0] = 0;
  ops::relu_l1_update(process_exec(), *coef, *i32_tensor({0, 0, 0, 0}, Shape{4}), *tokens, 1, 1.2);
  EXPECT_NEAR(coef->data<double>()[0], 0.3, 1e-15);
}

ModelConfig router_config(const std::string& router) {
  ModelConfig c = tiny_config(true, false);  // 2 layers of hidden 8
  c.mlp = "moe";
  c.moe.experts = 4;
  c.moe.top_k = 2;
  c.moe.expert_hidden = 6;
  c.moe.router = router;
  c.moe.z_loss = 0.01;
  c.moe.l1_coef = 0.05;
  return c;
}

// Every parameter against 4th-order finite differences of the objective: the LM head's
// loss plus the z-loss and, for relu, lambda x its L1 (one micro-batch: scale 1). The
// evaluation forward routes as the training one for these routers. expert_choice compares
// tokens, whose scores at this init sit within the steps of each other: its router's
// weights x 30 keep the choices clear (and its z-loss, whose high derivatives then swamp
// the differences, off).
void check_router_model_gradient(const ModelConfig& config, double router_scale, double eps) {
  const HostBatch batch = pack_docs(three_docs(), 4);
  Model m(config, tiny_build());
  m.allocate();
  init_tiny_model(m, 5);
  for (const auto& p : m.parameters())
    if (p->name().ends_with("mlp.gate.weight"))
      for (int64_t i = 0; i < p->value().numel(); ++i) p->value().data<double>()[i] *= router_scale;
  m.load_batch(batch);
  const double scale = 1.0 / static_cast<double>(batch.target_count);
  const LossTerms& terms = m.loss_terms();
  const int z = terms.find("moe_z"), l1 = terms.find("moe_l1");
  ASSERT_GE(z, 0);
  double lambda = 0;
  if (config.moe.router == "relu") {
    ASSERT_GE(l1, 0);
    lambda = m.find_parameter("layers.0.mlp.gate.l1_coef")->value().data<double>()[0];
    // Both layers' coefficients enter the objective; give them one value.
    m.find_parameter("layers.1.mlp.gate.l1_coef")->value().data<double>()[0] = lambda;
  }
  m.zero_grads();
  const LossSums fb = m.forward_backward(scale);
  if (l1 >= 0) EXPECT_GT(fb.slot[static_cast<size_t>(l1)], 0.0);
  EXPECT_NEAR(m.evaluate().loss, fb.loss, 1e-12);  // the evaluation routes as the training forward
  const auto objective = [&] {
    const LossSums s = m.evaluate();
    return s.loss * scale + config.moe.z_loss * s.slot[static_cast<size_t>(z)] +
           (l1 >= 0 ? lambda * s.slot[static_cast<size_t>(l1)] : 0.0);
  };
  GradCheckOptions o;
  o.order = 4;
  o.eps = eps;
  o.floor = 1e-4;
  o.tol = 1e-6;
  int64_t checked = 0;
  for (const auto& p : m.parameters()) {
    if (!p->trainable()) continue;
    const GradCheckReport r = check_gradient_scalar(p->value(), values_of(p->grad()), objective, o);
    EXPECT_TRUE(r.ok()) << p->name() << ": " << r.str();
    checked += r.checked;
  }
  EXPECT_GT(checked, 0);
}

TEST(MoeRouterModel, ExpertChoiceModelMatchesFiniteDifferences) {
  ModelConfig c = router_config("expert_choice");
  c.moe.z_loss = 1e-9;
  check_router_model_gradient(c, 30.0, 1e-5);
}

TEST(MoeRouterModel, ReluModelMatchesFiniteDifferences) { check_router_model_gradient(router_config("relu"), 1.0, 1e-4); }

// The decoder's logits for the last row of each prefix against the full forward of an
// evaluation (sinkhorn routes by its softmax in both; relu by its gates).
double decoder_vs_forward(const ModelConfig& c) {
  BuildOptions o = tiny_build(16);
  o.training = false;
  Model model(c, o);
  model.allocate();
  init_tiny_model(model, 9);
  DecoderOptions d;
  d.slots = 1;
  d.max_rows = 4;
  d.logit_rows = 4;
  Decoder decoder(model, d);
  const std::vector<int32_t> seq = {1, 5, 7, 2, 9, 3};
  double worst = 0;
  for (size_t len = 1; len <= seq.size(); ++len) {
    const std::vector<int32_t> token = {seq[len - 1]}, slot = {0}, position = {static_cast<int32_t>(len - 1)};
    decoder.forward(token, slot, position);
    std::vector<float> logits;
    decoder.logits(slot, logits);
    HostBatch b;
    b.tokens.assign(seq.begin(), seq.begin() + static_cast<std::ptrdiff_t>(len));
    b.targets.assign(len, kIgnoreTarget);
    b.positions.resize(len);
    std::iota(b.positions.begin(), b.positions.end(), 0);
    b.cu_seqlens = {0, static_cast<int32_t>(len)};
    b.max_seqlen = static_cast<int32_t>(len);
    model.load_batch(b);
    std::vector<float> want;
    model.logits(static_cast<int64_t>(len) - 1, 1, want);
    for (int64_t v = 0; v < c.vocab_size; ++v)
      worst = std::max(worst, std::abs(static_cast<double>(logits[static_cast<size_t>(v)]) - want[static_cast<size_t>(v)]));
  }
  return worst;
}

TEST(MoeRouterModel, SinkhornAndReluDecodeAsTheEvaluationForward) {
  for (const char* router : {"sinkhorn", "relu"}) {
    ModelConfig c = router_config(router);
    c.vocab_size = 13;
    EXPECT_LT(decoder_vs_forward(c), 1e-6) << router;
  }
}

// expert_choice is not causal: the decoder refuses it, naming the key and why.
TEST(MoeRouterModel, ExpertChoiceRefusesTheDecoder) {
  ModelConfig c = router_config("expert_choice");
  BuildOptions o = tiny_build(16);
  o.training = false;
  Model model(c, o);
  model.allocate();
  DecoderOptions d;
  d.slots = 1;
  d.max_rows = 4;
  d.logit_rows = 4;
  try {
    Decoder decoder(model, d);
    ADD_FAILURE() << "the decoder was built";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("model.moe.router"), std::string::npos) << what;
    EXPECT_NE(what.find("later tokens"), std::string::npos) << what;
  }
}

// A capacity factor of 0.5 keeps at most ceil(0.5 T k / E) pairs per expert in a training
// forward: about half the pairs (at least half less E) are dropped, counted and reported; an evaluation
// forward stays dropless (its loss differs from the dropping one's).
TEST(MoeRouterModel, CapacityDropsInTrainingAndReportsTheDrops) {
  ModelConfig c = router_config("softmax_topk");
  c.moe.capacity_factor = 0.5;
  Model m(c, tiny_build());
  m.allocate();
  init_tiny_model(m, 5);
  m.load_batch(pack_docs(three_docs(), 4));
  m.zero_grads();
  const double trained = m.forward_backward(1.0).loss;
  const double evaluated = m.evaluate().loss;
  EXPECT_NE(trained, evaluated);
  m.after_step(true);
  std::map<std::string, double> metrics;
  for (const auto& [name, value] : m.component_metrics()) metrics[name] = value;
  ASSERT_TRUE(metrics.count("moe.0.dropped")) << "no drop count";
  for (const char* layer : {"moe.0.", "moe.1."}) {
    const double share = metrics[std::string(layer) + "dropped_share"];
    EXPECT_GE(share, 0.3) << layer;
    EXPECT_LT(share, 1.0) << layer;
    EXPECT_GT(metrics[std::string(layer) + "dropped"], 0.0) << layer;
  }
  // Dropless (the default): no drop metrics.
  ModelConfig dropless = router_config("softmax_topk");
  Model d(dropless, tiny_build());
  d.allocate();
  for (const auto& [name, value] : d.component_metrics()) EXPECT_EQ(name.find("dropped"), std::string::npos) << name;
}

}  // namespace
}  // namespace kiln

namespace kiln {
namespace {

// Issue 38: a factor of 1e300 cast a capacity past INT64_MAX to int64_t ("capacity
// -9223372036854775808"); any factor past E / k keeps every token.
TEST(ExpertCapacity, AHugeFactorKeepsEveryTokenWithoutOverflowing) {
  MoeConfig moe;
  moe.experts = 8;
  moe.top_k = 2;
  EXPECT_EQ(expert_capacity(moe, 1000, 1e300), 1000);
  EXPECT_EQ(expert_capacity(moe, 1000, 4096), 1000);
  EXPECT_EQ(expert_capacity(moe, 1000, 1.0), 250);  // ceil(1 x 1000 x 2 / 8)
  EXPECT_EQ(expert_capacity(moe, 1000, 0), 0);
}

}  // namespace
}  // namespace kiln

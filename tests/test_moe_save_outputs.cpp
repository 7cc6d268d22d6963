// model.moe.save_outputs = false: the routing weights' gradient from the experts'
// activations (ops::moe_swiglu_backward, SonicMoE's form) instead of their saved outputs.
// The op against the chain it replaces (combine's backward, the down projection's, SwiGLU's)
// in f64, with an expert that gets no rows, empty and dropped pairs and rows past the live
// ones; then whole models: the same gradients as with the outputs saved, and the activation
// memory it frees. (test_moe.cpp checks every gradient against finite differences, with the
// default, false, and with true.)
#include "grad_check.h"
#include "ops/moe/moe.h"
#include "ops/swiglu/swiglu.h"
#include "test_util.h"
#include "tiny_model.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

namespace kiln {
namespace {

using namespace test;

OwnedTensor f64_random(Shape shape, uint64_t seed) {
  OwnedTensor t(DType::f64, Device::cpu, shape);
  Rng rng(seed);
  for (int64_t i = 0; i < t->numel(); ++i) t->data<double>()[i] = rng.normal();
  return t;
}

OwnedTensor f64_zeros(Shape shape) {
  OwnedTensor t(DType::f64, Device::cpu, shape);
  zero_tensor(*t);
  return t;
}

double largest_difference(const Tensor& a, const Tensor& b) {
  double most = 0;
  for (int64_t i = 0; i < a.numel(); ++i) most = std::max(most, std::fabs(a.data<double>()[i] - b.data<double>()[i]));
  return most;
}

// 6 tokens, 2 slots, 4 experts of width 5 (d = 3): expert 3 gets nothing, token 4's second
// slot is empty (-1), and a capacity of 3 drops expert 0's fourth and fifth pairs, so 3 of
// the 12 grouped rows are past the live ones.
TEST(MoeSwigluBackward, EqualsTheChainItReplaces) {
  const int64_t tokens = 6, k = 2, experts = 4, f = 5, d = 3, rows = tokens * k;
  OwnedTensor ids(DType::i32, Device::cpu, Shape{tokens, k});
  const std::vector<int32_t> chosen{0, 1, 0, 2, 1, 0, 2, 0, 0, -1, 1, 2};
  std::copy(chosen.begin(), chosen.end(), ids->data<int32_t>());
  OwnedTensor counts(DType::i32, Device::cpu, Shape{experts}), offsets(DType::i32, Device::cpu, Shape{experts + 1});
  OwnedTensor pair_of_row(DType::i32, Device::cpu, Shape{rows}), row_of_pair(DType::i32, Device::cpu, Shape{rows});
  const ops::MoeDispatch disp{experts, k, 3, *counts, *offsets, *pair_of_row, *row_of_pair, Tensor()};
  ops::moe_dispatch(process_exec(), *ids, disp);
  const int32_t live = offsets->data<int32_t>()[experts];
  ASSERT_EQ(live, 9);  // 11 routed pairs, two dropped

  const OwnedTensor gate_up = f64_random(Shape{rows, 2 * f}, 1), w_down = f64_random(Shape{experts * d, f}, 2);
  const OwnedTensor weights = f64_random(Shape{tokens, k}, 3), dout = f64_random(Shape{tokens, d}, 4);
  const ExecContext& ctx = process_exec();

  // The chain: y = (act W^T) saved, dweights = dout . y, dy = w dout, dact = dy W, SwiGLU's backward.
  OwnedTensor act = f64_zeros(Shape{rows, f}), y = f64_zeros(Shape{rows, d});
  ops::swiglu_forward(ctx, *gate_up, *act);
  ops::moe_grouped_linear_forward(ctx, *act, *w_down, disp, *y);
  OwnedTensor dy = f64_zeros(Shape{rows, d}), want_dweights = f64_zeros(Shape{tokens, k});
  ops::moe_combine_backward(ctx, *y, *weights, *dout, disp, *dy, *want_dweights);
  OwnedTensor dact = f64_zeros(Shape{rows, f}), want_dgate_up = f64_zeros(Shape{rows, 2 * f});
  OwnedTensor want_dw = f64_zeros(w_down->shape());
  ops::moe_grouped_linear_backward(ctx, *act, *w_down, *dy, disp, *dact, *want_dw);
  ops::swiglu_backward(ctx, *gate_up, *dact, *want_dgate_up);

  // The replacement, its weighted activation written over du (the layer's aliasing).
  OwnedTensor dg = f64_zeros(Shape{rows, d}), du = f64_zeros(Shape{rows, f});
  ops::moe_gather(ctx, *dout, disp, *dg);
  ops::moe_grouped_linear_backward(ctx, *du, *w_down, *dg, disp, *du, Tensor());
  OwnedTensor dgate_up = f64_random(Shape{rows, 2 * f}, 5), dweights = f64_random(Shape{tokens, k}, 6);
  ops::moe_swiglu_backward(ctx, *gate_up, *du, *weights, disp, *dgate_up, *du, *dweights);
  OwnedTensor dw = f64_zeros(w_down->shape());
  ops::moe_grouped_linear_backward(ctx, *du, *w_down, *dg, disp, Tensor(), *dw);

  EXPECT_LT(largest_difference(*dweights, *want_dweights), 1e-13);
  EXPECT_EQ(dweights->data<double>()[9], 0.0);  // the empty slot
  for (int64_t r = 0; r < live; ++r)
    for (int64_t j = 0; j < 2 * f; ++j)
      EXPECT_NEAR(dgate_up->data<double>()[r * 2 * f + j], want_dgate_up->data<double>()[r * 2 * f + j], 1e-13) << r;
  for (int64_t i = live * 2 * f; i < rows * 2 * f; ++i) EXPECT_EQ(dgate_up->data<double>()[i], 0.0);
  for (int64_t i = live * f; i < rows * f; ++i) EXPECT_EQ(du->data<double>()[i], 0.0);  // weighted_act past live
  EXPECT_LT(largest_difference(*dw, *want_dw), 1e-13);
  // The weighted activation: w_p act_r on the live rows.
  for (int64_t r = 0; r < live; ++r) {
    const double w = weights->data<double>()[pair_of_row->data<int32_t>()[r]];
    for (int64_t j = 0; j < f; ++j) EXPECT_NEAR(du->data<double>()[r * f + j], w * act->data<double>()[r * f + j], 1e-14);
  }
  // A dropped pair's weight gets no gradient either.
  for (int64_t p = 0; p < tokens * k; ++p)
    if (row_of_pair->data<int32_t>()[p] < 0) EXPECT_EQ(dweights->data<double>()[p], 0.0) << p;
}

ModelConfig sparse_config(const std::string& router, int64_t shared, bool save_outputs) {
  ModelConfig c = tiny_config(true, false);  // 2 layers of hidden 8
  c.mlp = "moe";
  c.moe.experts = 4, c.moe.top_k = 2, c.moe.expert_hidden = 6, c.moe.shared_hidden = shared;
  c.moe.router = router;
  c.moe.aux_loss = 0.05, c.moe.z_loss = 0.01;
  c.moe.routed_scaling = router == "sigmoid_bias" ? 1.5 : 1.0;
  c.moe.save_outputs = save_outputs;
  return c;
}

struct Gradients {
  LossSums sums;
  std::vector<std::vector<double>> grads;
  size_t activations = 0;
};

Gradients gradients_of(const ModelConfig& config) {
  const HostBatch batch = pack_docs(three_docs(), 4);
  Model m(config, tiny_build());
  m.allocate();
  init_tiny_model(m, 5);
  m.load_batch(batch);
  m.zero_grads();
  Gradients g;
  g.sums = m.forward_backward(1.0 / static_cast<double>(batch.target_count));
  for (const auto& p : m.parameters())
    if (p->trainable()) g.grads.push_back(values_of(p->grad()));
  g.activations = m.memory_plan().activations;
  return g;
}

// The same losses and gradients as the saved outputs give (f64: they differ only by the
// order of a few sums), and each sparse layer's [T k, d] rows of f64 less activation memory.
TEST(MoeSaveOutputs, OffGivesTheSameGradientsWithLessMemory) {
  for (const auto& [router, shared] : {std::pair{"softmax_topk", 0}, std::pair{"sigmoid_bias", 5},
                                       std::pair{"expert_choice", 0}, std::pair{"relu", 0}}) {
    SCOPED_TRACE(router);
    ModelConfig saved = sparse_config(router, shared, true), not_saved = sparse_config(router, shared, false);
    if (std::string(router) == "relu" || std::string(router) == "expert_choice") saved.moe.aux_loss = not_saved.moe.aux_loss = 0;
    const Gradients a = gradients_of(saved), b = gradients_of(not_saved);
    EXPECT_NEAR(a.sums.loss, b.sums.loss, 1e-12 * std::fabs(a.sums.loss));
    ASSERT_EQ(a.grads.size(), b.grads.size());
    for (size_t i = 0; i < a.grads.size(); ++i) {
      double most = 0, scale = 0;
      for (size_t j = 0; j < a.grads[i].size(); ++j) {
        most = std::max(most, std::fabs(a.grads[i][j] - b.grads[i][j]));
        scale = std::max(scale, std::fabs(a.grads[i][j]));
      }
      EXPECT_LE(most, 1e-12 * std::max(scale, 1e-300)) << "parameter " << i;
    }
    // Two sparse layers, each keeping at least T k rows x hidden 8 of f64 when saved.
    const size_t t = static_cast<size_t>(tiny_build().max_tokens);
    EXPECT_GE(a.activations, b.activations + 2 * t * 2 * 8 * sizeof(double));
  }
}

}  // namespace
}  // namespace kiln

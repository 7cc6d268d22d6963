// Whole-model gradient check in f64: Model::forward_backward's gradient of every parameter
// against finite differences of Model::evaluate(), on a tiny model (RMSNorm, RoPE, GQA
// attention with bias and optional q/k norm, SwiGLU, tied or untied head) over a packed
// batch of three documents and a PAD tail; the same with LayerNorm (with and without
// bias) and the GeGLU MLP. Also: gradients accumulate (+=) across calls
// and zero_grads clears them.
//
// Objective: (sums.loss + z * sums.z) * loss_scale with loss_scale = 1 / target_count;
// evaluate() runs without z-loss but still reports sums.z (the sum of lse^2), so the z-loss
// objective is formed from its sums exactly as forward_backward's gradient defines it.
// Derivatives: five-point central stencil, e = 1e-4 (plain central differences with e = 1e-6
// leave ~1e-5 relative noise here). Relative error |a - n| / max(|a|, |n|, 1e-4) must stay
// below 1e-6 (seen: <= 1e-7). Every element of every parameter is checked (1.5k-1.7k per
// variant); the finite differences run on one thread (fast, and two-thread runs under load
// are slow), after checking that the analytic gradient does not depend on the thread count.
#include "grad_check.h"
#include "tiny_model.h"

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <map>

namespace kiln {
namespace {

using namespace kiln::test;

struct Variant {
  bool qk_norm, tie;
  double z;
  std::string name() const { return fmt::format("qk_norm {} tie {} z {}", qk_norm, tie, z); }
};

std::vector<Variant> variants() {
  std::vector<Variant> v;
  for (bool qk : {true, false})
    for (bool tie : {true, false})
      for (double z : {0.0, 1e-3}) v.push_back({qk, tie, z});
  return v;
}

std::map<std::string, std::vector<double>> all_grads(const Model& m) {
  std::map<std::string, std::vector<double>> g;
  for (const auto& p : m.parameters()) g[p->name()] = values_of(p->grad());
  return g;
}

// The whole model's gradient against 4th-order finite differences, parameter by parameter.
void check_model_gradient(const ModelConfig& config, const Variant& v) {
  const HostBatch batch = pack_docs(three_docs(), 4);
  ASSERT_EQ(batch.size(), 20);
  ASSERT_EQ(batch.target_count, 15);
  {
    Model m(config, tiny_build(24, 7, v.z));
    m.allocate();
    init_tiny_model(m, 7);
    m.load_batch(batch);
    const double scale = 1.0 / static_cast<double>(batch.target_count);

    m.zero_grads();
    const LossSums fb = m.forward_backward(scale);
    const LossSums ev = m.evaluate();
    EXPECT_EQ(fb.count, batch.target_count);
    EXPECT_EQ(ev.count, batch.target_count);
    EXPECT_NEAR(fb.loss, ev.loss, 1e-13 * ev.loss);
    EXPECT_NEAR(fb.z, ev.z, 1e-13 * ev.z);
    EXPECT_GT(ev.loss / ev.count, 1.0);  // not a degenerate model

    // The same gradient on one thread as on the default count (then FD on one thread).
    const auto grads_default = all_grads(m);
    ScopedCpuThreads one_thread(1);
    m.zero_grads();
    m.forward_backward(scale);
    for (const auto& [name, g] : all_grads(m))
      for (size_t i = 0; i < g.size(); ++i)
        ASSERT_NEAR(g[i], grads_default.at(name)[i], 1e-13 * (1e-3 + std::abs(g[i]))) << name << " thread count";

    const auto objective = [&] {
      const LossSums s = m.evaluate();
      return (s.loss + v.z * s.z) * scale;
    };
    std::printf("[ %s ] %s\n", v.name().c_str(), expect_parameter_gradients_match(m, objective).str().c_str());
  }
}

TEST(ModulesGrad, ModelMatchesFiniteDifferences) {
  for (const Variant& v : variants()) {
    SCOPED_TRACE(v.name());
    check_model_gradient(tiny_config(v.qk_norm, v.tie), v);
  }
}

// The other norm and MLP components in the same model: LayerNorm with and without a bias
// (every norm of the model, the final one included) and the GeGLU MLP, each parameter
// (biases too: init_tiny_model moves them off zero) against finite differences. The
// parameter names are the ones the components promise.
TEST(ModulesGrad, LayerNormGegluModelMatchesFiniteDifferences) {
  for (const char* norm : {"layernorm", "layernorm_nobias"}) {
    SCOPED_TRACE(norm);
    ModelConfig c = tiny_config(true, false);
    c.norm = norm;
    c.mlp = "geglu";
    {
      Model m(c, tiny_build());
      const bool bias = std::string(norm) == "layernorm";
      for (const char* name : {"final_norm.weight", "layers.1.attn_norm.weight", "layers.0.mlp_norm.weight",
                               "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight",
                               "layers.1.mlp.down_proj.weight"})
        EXPECT_NE(m.find_parameter(name), nullptr) << name;
      for (const char* name : {"final_norm.bias", "layers.1.attn_norm.bias", "layers.0.mlp_norm.bias"})
        EXPECT_EQ(m.find_parameter(name) != nullptr, bias) << name;
    }
    check_model_gradient(c, Variant{true, false, 1e-3});
  }
}

// Gemma's RMSNorm (with Gemma's sqrt(hidden) embedding scale) and DyT, each as every norm of
// the model and as the q/k norm, with the ungated MLPs (gelu, relu2): each parameter (DyT's alpha and bias too) against finite
// differences, under the names the components promise. relu2's second derivative jumps at 0,
// which the five-point stencil only sees for a pre-activation within 2e-4 of it.
TEST(ModulesGrad, GemmaDytUngatedModelMatchesFiniteDifferences) {
  struct Combo {
    const char *norm, *mlp;
  };
  for (const Combo combo : {Combo{"gemma_rmsnorm", "gelu"}, Combo{"dyt", "relu2"}, Combo{"dyt", "gelu"}}) {
    SCOPED_TRACE(fmt::format("{} {}", combo.norm, combo.mlp));
    ModelConfig c = tiny_config(true, false);
    c.norm = combo.norm;
    c.qk_norm_type = combo.norm;
    c.mlp = combo.mlp;
    c.ungated_ffn_hidden = 10;
    if (std::string(combo.norm) == "gemma_rmsnorm") c.embed_scale = std::sqrt(static_cast<double>(c.hidden));  // Gemma's
    {
      Model m(c, tiny_build());
      const bool dyt = std::string(combo.norm) == "dyt";
      for (const char* name : {"final_norm.weight", "layers.1.attn_norm.weight", "layers.0.attn.q_norm.weight",
                               "layers.1.attn.k_norm.weight", "layers.0.mlp.up_proj.weight",
                               "layers.1.mlp.down_proj.weight"})
        EXPECT_NE(m.find_parameter(name), nullptr) << name;
      for (const char* name : {"final_norm.alpha", "layers.0.mlp_norm.bias", "layers.1.attn.q_norm.alpha",
                               "layers.1.attn.k_norm.bias"})
        EXPECT_EQ(m.find_parameter(name) != nullptr, dyt) << name;
      EXPECT_EQ(m.find_parameter("layers.0.mlp.gate_proj.weight"), nullptr);
      EXPECT_EQ(m.find_parameter("layers.0.mlp.up_proj.weight")->shape(), (Shape{10, 8}));
    }
    check_model_gradient(c, Variant{true, false, 1e-3});
  }
}

// DyT blocks with another norm before the LM head (model.final_norm): the final norm's
// parameters are RMSNorm's, under its names, and every gradient matches.
TEST(ModulesGrad, DytBlocksWithAnRmsNormBeforeTheHeadMatchFiniteDifferences) {
  ModelConfig c = tiny_config(true, false);
  c.norm = "dyt";
  c.final_norm = "rmsnorm";
  {
    Model m(c, tiny_build());
    EXPECT_NE(m.find_parameter("layers.0.attn_norm.alpha"), nullptr);
    EXPECT_NE(m.find_parameter("final_norm.weight"), nullptr);
    EXPECT_EQ(m.find_parameter("final_norm.alpha"), nullptr);
  }
  check_model_gradient(c, Variant{true, false, 1e-3});
}

// A sliding window (2 tokens: it bites on every document here), an attention softcap and an
// LM-head softcap, each small enough to change the logits a lot.
TEST(ModulesGrad, WindowedSoftcappedModelMatchesFiniteDifferences) {
  ModelConfig c = tiny_config(true, false);
  c.sliding_window = 2;
  c.attention_softcap = 0.5;
  c.logit_softcap = 2.0;
  check_model_gradient(c, Variant{true, false, 1e-3});
}

// A per-layer pattern: layer 0 windowed (2 tokens), layer 1 full attention without RoPE.
TEST(ModulesGrad, PerLayerPatternModelMatchesFiniteDifferences) {
  ModelConfig c = tiny_config(true, false);
  c.sliding_window = 2;
  c.full_attention_layers = "1";
  c.nope_layers = "1";
  check_model_gradient(c, Variant{true, false, 1e-3});
}

// Partial rotary: half of each 4-dim head rotated (one pair), the other pair passed through.
TEST(ModulesGrad, PartialRotaryModelMatchesFiniteDifferences) {
  ModelConfig c = tiny_config(true, false);
  c.rope.fraction = 0.5;
  check_model_gradient(c, Variant{true, false, 1e-3});
}

// Sandwich norms (Gemma 2/3): a norm on each branch's output before its residual add, of
// the model's norm kind (Gemma's, with its embedding scale, and the plain RMSNorm), under
// the names they promise (Gemma's for Hugging Face and llama.cpp).
TEST(ModulesGrad, SandwichNormModelMatchesFiniteDifferences) {
  for (const char* norm : {"gemma_rmsnorm", "rmsnorm"}) {
    SCOPED_TRACE(norm);
    ModelConfig c = tiny_config(true, false);
    c.norm = norm;
    c.mlp = "geglu";
    c.sandwich_norms = true;
    if (std::string(norm) == "gemma_rmsnorm") c.embed_scale = std::sqrt(static_cast<double>(c.hidden));
    {
      Model m(c, tiny_build());
      const Parameter* post_attn = m.find_parameter("layers.1.post_attn_norm.weight");
      const Parameter* post_mlp = m.find_parameter("layers.0.post_mlp_norm.weight");
      const Parameter* pre_mlp = m.find_parameter("layers.0.mlp_norm.weight");
      ASSERT_NE(post_attn, nullptr);
      ASSERT_NE(post_mlp, nullptr);
      ASSERT_NE(pre_mlp, nullptr);
      EXPECT_EQ(post_attn->names().hf, "model.layers.1.post_attention_layernorm.weight");
      EXPECT_EQ(post_attn->names().gguf, "blk.1.post_attention_norm.weight");
      EXPECT_EQ(post_mlp->names().hf, "model.layers.0.post_feedforward_layernorm.weight");
      EXPECT_EQ(post_mlp->names().gguf, "blk.0.post_ffw_norm.weight");
      EXPECT_EQ(pre_mlp->names().hf, "model.layers.0.pre_feedforward_layernorm.weight");
    }
    check_model_gradient(c, Variant{true, false, 1e-3});
  }
}

// Attention sinks (GPT-OSS): a [heads] parameter per layer under GPT-OSS's names, its
// gradient and every other one matching finite differences, with a window of 2 on layer 0
// and full attention on layer 1 over the packed documents.
TEST(ModulesGrad, AttentionSinksModelMatchesFiniteDifferences) {
  ModelConfig c = tiny_config(true, false);
  c.attention_sinks = true;
  c.sliding_window = 2;
  c.full_attention_layers = "1";
  {
    Model m(c, tiny_build());
    const Parameter* sinks = m.find_parameter("layers.1.attn.sinks");
    ASSERT_NE(sinks, nullptr);
    EXPECT_EQ(sinks->shape(), (Shape{c.heads}));
    EXPECT_EQ(sinks->names().hf, "model.layers.1.self_attn.sinks");
    EXPECT_EQ(sinks->names().gguf, "blk.1.attn_sinks.weight");
  }
  check_model_gradient(c, Variant{true, false, 1e-3});
}

// Gemma 3's local RoPE base: the windowed layer (0) rotates by model.rope.local_theta, the
// global one (1) by model.rope_theta.
TEST(ModulesGrad, LocalRopeBaseModelMatchesFiniteDifferences) {
  ModelConfig c = tiny_config(true, false);
  c.sliding_window = 2;
  c.full_attention_layers = "1";
  c.rope_theta = 1e6;
  c.rope.local_theta = 3.0;  // a base this small turns by a large angle per position: it bites
  check_model_gradient(c, Variant{true, false, 1e-3});
}

// The loss of the tiny model (seed 7, three documents and a PAD tail) with `edit` applied
// to its config.
double loss_of(const std::function<void(ModelConfig&)>& edit) {
  const HostBatch batch = pack_docs(three_docs(), 4);
  ModelConfig c = tiny_config(true, true);
  edit(c);
  Model m(c, tiny_build());
  m.allocate();
  init_tiny_model(m, 7);
  m.load_batch(batch);
  return m.evaluate().loss;
}

// Each pattern key reaches only the layers it names: exempting every layer from the window
// is the plain model, and the window or NoPE on one layer changes the loss, differently
// for each layer.
TEST(ModulesGrad, LayerPatternsApplyToTheLayersTheyName) {
  const double plain = loss_of([](ModelConfig&) {});
  EXPECT_EQ(loss_of([](ModelConfig& c) { c.sliding_window = 2, c.full_attention_layers = "all"; }), plain);
  const double window0 = loss_of([](ModelConfig& c) { c.sliding_window = 2, c.full_attention_layers = "1"; });
  const double window1 = loss_of([](ModelConfig& c) { c.sliding_window = 2, c.full_attention_layers = "~1"; });
  const double window_both = loss_of([](ModelConfig& c) { c.sliding_window = 2; });
  EXPECT_NE(window0, plain);
  EXPECT_NE(window1, plain);
  EXPECT_NE(window0, window1);
  EXPECT_NE(window0, window_both);
  const double nope0 = loss_of([](ModelConfig& c) { c.nope_layers = "0"; });
  const double nope1 = loss_of([](ModelConfig& c) { c.nope_layers = "every:2"; });
  EXPECT_NE(nope0, plain);
  EXPECT_NE(nope1, plain);
  EXPECT_NE(nope0, nope1);
  EXPECT_EQ(loss_of([](ModelConfig& c) { c.nope_layers = "0-1"; }), loss_of([](ModelConfig& c) { c.position = "none"; }));
}

// The three options change the model only where they bite: a window as long as the context
// and caps far above every logit give the plain model's loss; small ones change it.
TEST(ModulesGrad, WindowAndSoftcapsChangeTheLossOnlyWhenTheyBite) {
  const double plain = loss_of([](ModelConfig&) {});
  EXPECT_EQ(loss_of([](ModelConfig& c) { c.sliding_window = c.max_seq_len; }), plain);
  EXPECT_NE(loss_of([](ModelConfig& c) { c.sliding_window = 2; }), plain);
  EXPECT_NEAR(loss_of([](ModelConfig& c) { c.attention_softcap = 1e6; }), plain, 1e-9 * plain);
  EXPECT_GT(std::abs(loss_of([](ModelConfig& c) { c.attention_softcap = 0.1; }) - plain), 1e-6 * plain);
  EXPECT_NEAR(loss_of([](ModelConfig& c) { c.logit_softcap = 1e6; }), plain, 1e-9 * plain);
  EXPECT_GT(std::abs(loss_of([](ModelConfig& c) { c.logit_softcap = 0.5; }) - plain), 1e-6 * plain);
}

// Sandwich norms change the model (their gradients are checked above).
TEST(ModulesGrad, SandwichNormsChangeTheLoss) {
  EXPECT_NE(loss_of([](ModelConfig& c) { c.sandwich_norms = true; }), loss_of([](ModelConfig&) {}));
}

// Sinks change the loss (they take a share of every softmax).
TEST(ModulesGrad, AttentionSinksChangeTheLoss) {
  EXPECT_NE(loss_of([](ModelConfig& c) { c.attention_sinks = true; }), loss_of([](ModelConfig&) {}));
}

// model.rope.local_theta reaches the windowed layers only: equal to rope_theta it is the
// plain model bitwise; another base changes the loss with a windowed layer 0 or 1, by a
// different amount for each.
TEST(ModulesGrad, LocalRopeBaseAppliesToTheWindowedLayersOnly) {
  auto windowed = [](const char* global, double local) {
    return [=](ModelConfig& c) {
      c.sliding_window = 3, c.full_attention_layers = global, c.rope.local_theta = local;
    };
  };
  const double plain = loss_of(windowed("1", 0));
  EXPECT_EQ(loss_of(windowed("1", 10000.0)), plain);  // rope_theta's default
  const double local0 = loss_of(windowed("1", 3.0));
  const double local1 = loss_of(windowed("0", 3.0));
  EXPECT_NE(local0, plain);
  EXPECT_NE(local1, loss_of(windowed("0", 0)));
  EXPECT_NE(local0 - plain, local1 - loss_of(windowed("0", 0)));
}

TEST(ModulesGrad, ZLossChangesTheGradient) {
  // The z-loss gradient path is live: with z > 0 the gradient differs from z = 0 by about
  // d(z * sum lse^2) — and by exactly that, per the finite-difference test above.
  const HostBatch batch = pack_docs(three_docs(), 4);
  auto gradients = [&](double z) {
    Model m(tiny_config(true, true), tiny_build(24, 7, z));
    m.allocate();
    init_tiny_model(m, 7);
    m.load_batch(batch);
    m.zero_grads();
    m.forward_backward(1.0);
    return all_grads(m);
  };
  const auto g0 = gradients(0.0), g1 = gradients(1e-3);
  double diff = 0;
  for (const auto& [name, g] : g0)
    for (size_t i = 0; i < g.size(); ++i) diff = std::max(diff, std::abs(g[i] - g1.at(name)[i]));
  EXPECT_GT(diff, 1e-6);
}

TEST(ModulesGrad, GradientsAccumulateAndZeroGradsClears) {
  const HostBatch batch = pack_docs(three_docs(), 4);
  for (bool tie : {true, false}) {
    SCOPED_TRACE(tie ? "tied" : "untied");
    Model m(tiny_config(true, tie), tiny_build(24, 7, 1e-3));
    m.allocate();
    init_tiny_model(m, 11);
    m.load_batch(batch);
    const double scale = 1.0 / static_cast<double>(batch.target_count);
    m.zero_grads();
    m.forward_backward(scale);
    const auto once = all_grads(m);
    m.forward_backward(scale);  // no zero_grads: += on top
    const auto twice = all_grads(m);
    // A second batch (different documents) accumulates as the sum of both gradients.
    HostBatch other = pack_docs({three_docs()[2], three_docs()[0]}, 2);
    Model ref(tiny_config(true, tie), tiny_build(24, 7, 1e-3));
    ref.allocate();
    init_tiny_model(ref, 11);
    ref.load_batch(other);
    ref.zero_grads();
    ref.forward_backward(scale);
    const auto other_grads = all_grads(ref);
    m.load_batch(other);
    m.forward_backward(scale);
    const auto thrice = all_grads(m);
    for (const auto& [name, g] : once) {
      double scale_g = 0;
      for (double x : g) scale_g = std::max(scale_g, std::abs(x));
      ASSERT_GT(scale_g, 0.0) << name << " has no gradient";
      for (size_t i = 0; i < g.size(); ++i) {
        EXPECT_NEAR(twice.at(name)[i], 2 * g[i], 1e-14 * scale_g) << name << "[" << i << "]";
        EXPECT_NEAR(thrice.at(name)[i], 2 * g[i] + other_grads.at(name)[i], 1e-13 * scale_g) << name << "[" << i << "]";
      }
    }
    m.zero_grads();
    for (const auto& [name, g] : all_grads(m))
      for (double x : g) ASSERT_EQ(x, 0.0) << name;
    // And after clearing, one call gives the single gradient again.
    m.load_batch(batch);
    m.forward_backward(scale);
    for (const auto& [name, g] : all_grads(m))
      for (size_t i = 0; i < g.size(); ++i) EXPECT_NEAR(g[i], once.at(name)[i], 1e-15 + 1e-13 * std::abs(g[i])) << name;
  }
}

TEST(ModulesGrad, GradientIsLinearInLossScale) {
  const HostBatch batch = pack_docs(three_docs(), 4);
  Model m(tiny_config(false, false), tiny_build(24, 7, 1e-3));
  m.allocate();
  init_tiny_model(m, 3);
  m.load_batch(batch);
  m.zero_grads();
  m.forward_backward(0.25);
  const auto a = all_grads(m);
  m.zero_grads();
  m.forward_backward(1.0);
  const auto b = all_grads(m);
  for (const auto& [name, g] : a)
    for (size_t i = 0; i < g.size(); ++i) EXPECT_NEAR(4 * g[i], b.at(name)[i], 1e-13 * (1 + std::abs(b.at(name)[i]))) << name;
}

}  // namespace
}  // namespace kiln

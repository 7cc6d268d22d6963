// bf16 master weights (optim.master_weights = "bf16"): the stochastic rounding
// (ops/optim/stochastic_round.h) bit by bit, AdamW's step on a bf16 master against the same
// step computed in double, the planned memory, and the config's refusals.
#include "config/config.h"
#include "model/model.h"
#include "ops/attention/qk_clip.h"
#include "ops/embedding/embedding.h"
#include "ops/optim/adamw_bf16_master.h"
#include "ops/optim/muon.h"
#include "ops/optim/stochastic_round.h"
#include "train/checkpoint_state.h"
#include "train/memory_check.h"
#include "train/training_build.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <vector>

namespace kiln {
namespace {

using ops::bf16_bits_to_float;
using ops::rounding_bits;
using ops::stochastic_round_bf16;

float from_bits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// Every finite and infinite bf16 value stays itself whatever the random bits.
TEST(StochasticRound, RepresentableValuesStayUnchanged) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    if ((h & 0x7f80) == 0x7f80 && (h & 0x7f) != 0) continue;  // NaN: below
    const float x = bf16_bits_to_float(static_cast<uint16_t>(h));
    for (const uint32_t r : {0u, 1u, 0x7fffu, 0x8000u, 0xffffu, rounding_bits(7, 3, h)})
      ASSERT_EQ(stochastic_round_bf16(x, r), h) << "bf16 " << h << " r " << r;
  }
}

// Over all 65536 random values, x rounds up exactly low16(x) times: the probability of rounding
// up is the fraction of the way to the next bf16 value, exactly. Ties (low16 = 0x8000) go
// either way half the time; a negative value rounds as its magnitude does, with its sign.
TEST(StochasticRound, RoundsUpWithExactlyTheFractionOfTheWay) {
  for (const uint32_t bits : {0x3f800001u, 0x3f808000u, 0x3f80ffffu, 0x3fc01234u, 0x00000007u, 0x00018000u,
                              0x7f7f0001u, 0x42f6e979u}) {
    const uint32_t low = bits & 0xffffu;
    const uint16_t down = static_cast<uint16_t>(bits >> 16), up = static_cast<uint16_t>(down + 1);
    for (const uint32_t sign : {0u, 0x80000000u}) {
      const float x = from_bits(bits | sign);
      uint32_t ups = 0;
      for (uint32_t r = 0; r < 0x10000; ++r) {
        const uint16_t h = stochastic_round_bf16(x, r);
        const uint16_t magnitude = h & 0x7fff;
        ASSERT_TRUE(magnitude == down || magnitude == up) << std::hex << bits << " -> " << h;
        ASSERT_EQ(h & 0x8000, sign >> 16) << "the sign must be kept";
        ups += magnitude == up;
      }
      EXPECT_EQ(ups, low) << std::hex << (bits | sign);
    }
  }
}

// The mean of many roundings of one value (random bits from the counter-based hash over the
// element index) converges to the value: within 5 standard deviations of the binomial count.
TEST(StochasticRound, MeanOfManyRoundingsIsTheValue) {
  const int64_t n = 1 << 18;
  for (const float x : {1.0f + 1e-4f, -3.14159f, 1e-3f, 0.1f, -7.5e-39f, 65504.3f}) {
    const uint32_t bits = ops::float_bits(x);
    const double lo = bf16_bits_to_float(static_cast<uint16_t>(bits >> 16));
    const double hi = bf16_bits_to_float(static_cast<uint16_t>((bits >> 16) + 1));
    const double p = static_cast<double>(bits & 0xffffu) / 65536.0;
    double sum = 0;
    for (int64_t i = 0; i < n; ++i)
      sum += bf16_bits_to_float(stochastic_round_bf16(x, rounding_bits(ops::rounding_stream("w"), 5, i)));
    const double mean = sum / static_cast<double>(n);
    const double sigma = std::abs(hi - lo) * std::sqrt(p * (1 - p) / static_cast<double>(n));
    std::printf("x %.9g: mean %.9g, |error| %.3g, 5 sigma %.3g\n", x, mean, std::abs(mean - x), 5 * sigma);
    EXPECT_LE(std::abs(mean - static_cast<double>(x)), 5 * sigma + 1e-12 * std::abs(x)) << x;
    // Round to nearest would be off by min(p, 1-p) of a step; the test can tell the two apart.
    EXPECT_GT(std::min(p, 1 - p) * std::abs(hi - lo), 5 * sigma) << "a value too close to bf16 to test";
  }
}

TEST(StochasticRound, NanAndInfinityPassThrough) {
  const float inf = std::numeric_limits<float>::infinity();
  for (const uint32_t r : {0u, 0xffffu, 0x1234u}) {
    EXPECT_EQ(stochastic_round_bf16(inf, r), 0x7f80);
    EXPECT_EQ(stochastic_round_bf16(-inf, r), 0xff80);
    for (const uint32_t nan : {0x7fc00000u, 0x7f800001u, 0xffffffffu, 0x7fa00000u}) {
      const uint16_t h = stochastic_round_bf16(from_bits(nan), r);
      EXPECT_TRUE(std::isnan(bf16_bits_to_float(h))) << std::hex << nan << " -> " << h;
      EXPECT_EQ(h & 0x8000, (nan >> 16) & 0x8000) << "NaN keeps its sign";
    }
    EXPECT_EQ(stochastic_round_bf16(0.0f, r), 0x0000);
    EXPECT_EQ(stochastic_round_bf16(-0.0f, r), 0x8000);
  }
  // Above the largest finite bf16 the far neighbour is inf.
  const float big = std::numeric_limits<float>::max();
  EXPECT_EQ(stochastic_round_bf16(big, 0), 0x7f7f);
  EXPECT_EQ(stochastic_round_bf16(big, 0xffff), 0x7f80);
}

// The bits depend on every part of the key, and on nothing else.
TEST(StochasticRound, BitsAreACounterBasedFunctionOfTheKey) {
  const uint64_t s = ops::rounding_stream("layers.0.attn.q_proj.weight");
  EXPECT_EQ(s, ops::rounding_stream("layers.0.attn.q_proj.weight"));
  EXPECT_NE(s, ops::rounding_stream("layers.0.attn.k_proj.weight"));
  EXPECT_EQ(rounding_bits(s, 3, 10), rounding_bits(s, 3, 10));
  int same_update = 0, same_index = 0, same_stream = 0;
  std::vector<int64_t> buckets(16, 0);
  for (uint64_t i = 0; i < 4096; ++i) {
    const uint32_t r = rounding_bits(s, 3, i);
    ASSERT_LT(r, 0x10000u);
    same_update += r == rounding_bits(s, 4, i);
    same_index += r == rounding_bits(s, 3, i + 4096);
    same_stream += r == rounding_bits(s + 1, 3, i);
    ++buckets[r >> 12];
  }
  // Equal by chance about 4096 / 65536 times in 4096.
  EXPECT_LT(same_update, 8);
  EXPECT_LT(same_index, 8);
  EXPECT_LT(same_stream, 8);
  for (const int64_t b : buckets) EXPECT_NEAR(static_cast<double>(b), 256.0, 5 * 16.0);  // 5 sigma of a bucket
}

ops::AdamWStep step_of(int64_t t) {
  ops::AdamWStep s;
  s.lr = 1e-3;
  s.bias_correction1 = 1 - std::pow(s.beta1, static_cast<double>(t));
  s.bias_correction2 = 1 - std::pow(s.beta2, static_cast<double>(t));
  return s;
}

// One AdamW step on bf16 masters: m and v as the fp32 update computes them, and the new weight
// one of the two bf16 neighbours of the update computed in double; over many rounding streams
// the weights' mean is the double result.
TEST(AdamWBf16Master, StepIsTheDoubleUpdateRoundedStochastically) {
  const int64_t n = 4099;
  std::mt19937 gen(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint16_t> p0(n);
  std::vector<float> g(n), m0(n), v0(n);
  for (int64_t i = 0; i < n; ++i) {
    p0[i] = float_to_bf16(0.05f * normal(gen));
    g[i] = 0.01f * normal(gen);
    m0[i] = 0.01f * normal(gen);
    v0[i] = 1e-4f * std::abs(normal(gen));
  }
  const ops::AdamWStep s = step_of(3);
  const double wd = 0.1;
  const int streams = 400;
  std::vector<double> mean(n, 0.0);
  std::vector<float> m, v;
  for (int k = 0; k < streams; ++k) {
    std::vector<uint16_t> p = p0;
    m = m0, v = v0;
    ops::adamw_bf16_master_reference(p.data(), g.data(), m.data(), v.data(), n, s, wd, static_cast<uint64_t>(k), 3, 0);
    for (int64_t i = 0; i < n; ++i) mean[i] += bf16_bits_to_float(p[i]) / streams;
    if (k > 0) continue;
    for (int64_t i = 0; i < n; ++i) {  // the first stream: every element against double
      const double md = s.beta1 * m0[i] + (1 - s.beta1) * g[i];
      const double vd = s.beta2 * v0[i] + (1 - s.beta2) * static_cast<double>(g[i]) * g[i];
      const double wd_new = bf16_bits_to_float(p0[i]) * (1 - s.lr * wd) -
                            s.lr / s.bias_correction1 * md / (std::sqrt(vd / s.bias_correction2) + s.eps);
      // fp32 rounding of each term (m may cancel): relative to the terms, not the sum.
      ASSERT_NEAR(m[i], md, 1e-6 * (s.beta1 * std::abs(m0[i]) + (1 - s.beta1) * std::abs(g[i])));
      ASSERT_NEAR(v[i], vd, 1e-6 * vd + 1e-15);
      // A neighbour of the double result: less than one bf16 step away from it.
      const double got = bf16_bits_to_float(p[i]);
      const double step = std::ldexp(1.0, std::ilogb(wd_new) - 7);
      ASSERT_LE(std::abs(got - wd_new), step * (1 + 1e-5))
          << i << ": " << got << " outside the bf16 neighbours of " << wd_new;
    }
  }
  // The mean over streams: within 5 sigma of the double result (sigma <= half a bf16 step / sqrt(streams)).
  int64_t far = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double md = s.beta1 * m0[i] + (1 - s.beta1) * g[i];
    const double vd = s.beta2 * v0[i] + (1 - s.beta2) * static_cast<double>(g[i]) * g[i];
    const double wd_new = bf16_bits_to_float(p0[i]) * (1 - s.lr * wd) -
                          s.lr / s.bias_correction1 * md / (std::sqrt(vd / s.bias_correction2) + s.eps);
    const double ulp = std::abs(wd_new) * std::ldexp(1.0, -7);
    far += std::abs(mean[i] - wd_new) > 5 * 0.5 * ulp / std::sqrt(static_cast<double>(streams)) + 1e-9;
  }
  std::printf("adamw bf16 master: %lld of %lld means beyond 5 sigma of the double update\n",
              static_cast<long long>(far), static_cast<long long>(n));
  EXPECT_LE(far, 2);
}

// A step far below half a bf16 ulp: round to nearest never moves the weight; stochastic
// rounding moves it on average by the step.
TEST(AdamWBf16Master, TinyUpdatesSurviveOnAverage) {
  const int64_t n = 1 << 14;
  std::vector<uint16_t> p(n, float_to_bf16(1.0f));
  std::vector<float> g(n, 1.0f), m(n, 0.0f), v(n, 0.0f);
  ops::AdamWStep s = step_of(1);
  s.lr = 1e-4;  // the first step moves by lr (m / sqrt(v) = 1); bf16's ulp at 1 is 2^-7
  ops::adamw_bf16_master_reference(p.data(), g.data(), m.data(), v.data(), n, s, 0.0, 9, 1, 0);
  double mean = 0;
  for (const uint16_t h : p) mean += bf16_bits_to_float(h) / static_cast<double>(n);
  const double sigma = std::ldexp(1.0, -8) * 0.5 / std::sqrt(static_cast<double>(n));  // ulp below 1 is 2^-8
  EXPECT_NEAR(mean, 1.0 - 1e-4, 5 * sigma);
  EXPECT_LT(mean, 1.0 - 5e-5) << "the update vanished as under round to nearest";
}

// The op on CPU tensors is the reference on their arrays, resumable: the same update number
// gives the same bits.
TEST(AdamWBf16Master, OpMatchesTheReferenceAndRepeats) {
  const int64_t n = 1001;
  OwnedTensor p(DType::bf16, Device::cpu, Shape{n}), g(DType::f32, Device::cpu, Shape{n}),
      m(DType::f32, Device::cpu, Shape{n}), v(DType::f32, Device::cpu, Shape{n});
  std::vector<uint16_t> p_ref(n);
  std::vector<float> g_ref(n), m_ref(n, 0.0f), v_ref(n, 0.0f);
  for (int64_t i = 0; i < n; ++i) {
    p_ref[i] = float_to_bf16(std::sin(static_cast<float>(i)) * 0.1f);
    g_ref[i] = std::cos(static_cast<float>(i) * 0.37f) * 0.01f;
  }
  std::memcpy(p->raw(), p_ref.data(), 2 * n);
  std::memcpy(g->raw(), g_ref.data(), 4 * n);
  zero_tensor(*m), zero_tensor(*v);
  const std::vector<ops::AdamWBf16MasterTensor> list{{*p, *g, *m, *v, 0.1, 77, 5}};
  ops::adamw_bf16_master_update_all(process_exec(), list, step_of(2), 2);
  ops::adamw_bf16_master_reference(p_ref.data(), g_ref.data(), m_ref.data(), v_ref.data(), n, step_of(2), 0.1, 77, 2, 5);
  EXPECT_EQ(std::memcmp(p->raw(), p_ref.data(), 2 * n), 0);
  EXPECT_EQ(std::memcmp(m->raw(), m_ref.data(), 4 * n), 0);
  OwnedTensor wrong(DType::f32, Device::cpu, Shape{n});
  const std::vector<ops::AdamWBf16MasterTensor> bad{{*wrong, *g, *m, *v, 0.1, 77, 0}};
  EXPECT_THROW(ops::adamw_bf16_master_update_all(process_exec(), bad, step_of(2), 2), Error);
}

// The embedding lookup reads a bf16 master table into the fp32 residual stream, exactly.
TEST(Bf16Masters, EmbeddingWidensBf16TableRowsExactly) {
  const int64_t vocab = 7, dim = 5;
  OwnedTensor table(DType::bf16, Device::cpu, Shape{vocab, dim}), tokens(DType::i32, Device::cpu, Shape{3}),
      rows(DType::f32, Device::cpu, Shape{3, dim});
  auto* bits = static_cast<uint16_t*>(table->raw());
  for (int64_t i = 0; i < vocab * dim; ++i) bits[i] = float_to_bf16(0.37f * static_cast<float>(i) - 3.0f);
  const int32_t ids[3] = {6, 0, 6};
  std::memcpy(tokens->raw(), ids, sizeof(ids));
  ops::embedding_forward(process_exec(), *tokens, *table, *rows);
  for (int64_t r = 0; r < 3; ++r)
    for (int64_t c = 0; c < dim; ++c)
      EXPECT_EQ(rows->data<float>()[r * dim + c], bf16_to_float(bits[ids[r] * dim + c]));
  const int32_t bad[3] = {0, 7, 1};
  std::memcpy(tokens->raw(), bad, sizeof(bad));
  EXPECT_THROW(ops::embedding_forward(process_exec(), *tokens, *table, *rows), Error);
}

// Muon on a bf16 master: the momentum and the orthogonalized update are those of the fp32
// master (they never read the weight), and the new weight is that fp32 result rounded with
// the bits of (stream, update, index): bit for bit, against Muon on the widened weight.
TEST(Bf16Masters, MuonRoundsTheFp32UpdateStochastically) {
  const int64_t rows = 24, cols = 40, n = rows * cols;
  OwnedTensor p16(DType::bf16, Device::cpu, Shape{rows, cols}), p32(DType::f32, Device::cpu, Shape{rows, cols});
  OwnedTensor g(DType::f32, Device::cpu, Shape{rows, cols}), m16(DType::f32, Device::cpu, Shape{rows, cols}),
      m32(DType::f32, Device::cpu, Shape{rows, cols});
  auto* bits = static_cast<uint16_t*>(p16->raw());
  for (int64_t i = 0; i < n; ++i) {
    bits[i] = float_to_bf16(0.02f * std::sin(0.7f * static_cast<float>(i)));
    p32->data<float>()[i] = bf16_to_float(bits[i]);
    g->data<float>()[i] = 0.01f * std::cos(1.3f * static_cast<float>(i) + 0.2f);
  }
  zero_tensor(*m16), zero_tensor(*m32);
  const uint64_t stream = ops::rounding_stream("layers.0.mlp.down_proj.weight");
  ops::MuonUpdate wide(ops::MuonSettings{}, {Shape{rows, cols}}, Device::cpu), narrow(ops::MuonSettings{}, {Shape{rows, cols}}, Device::cpu);
  for (int64_t update = 1; update <= 3; ++update) {
    wide.step(process_exec(), {{*p32, *g, *m32, 0.1, 2.0, 0}}, 0.02, 1.0, update);
    narrow.step(process_exec(), {{*p16, *g, *m16, 0.1, 2.0, stream}}, 0.02, 1.0, update);
    ASSERT_EQ(std::memcmp(m16->raw(), m32->raw(), 4 * n), 0) << "the momentum must not depend on the master";
    int64_t moved = 0;
    for (int64_t i = 0; i < n; ++i) {
      const uint16_t expected =
          stochastic_round_bf16(p32->data<float>()[i], rounding_bits(stream, static_cast<uint64_t>(update), i));
      ASSERT_EQ(bits[i], expected) << "update " << update << " element " << i;
      moved += bits[i] != float_to_bf16(p32->data<float>()[i]);
      p32->data<float>()[i] = bf16_to_float(bits[i]);  // the next step starts from the bf16 master
    }
    EXPECT_GT(moved, 0) << "stochastic rounding should differ from nearest somewhere";
  }
  OwnedTensor g16(DType::bf16, Device::cpu, Shape{rows, cols});
  EXPECT_THROW(narrow.step(process_exec(), {{*p16, *g16, *m16, 0.1, 2.0, stream}}, 0.02, 1.0, 4), Error);
}

// QK-Clip's rescale of a bf16 master: each row of head h times factors[h] in fp32, rounded to
// nearest even.
TEST(Bf16Masters, QkClipScalesBf16HeadRows) {
  const int64_t head_dim = 3, heads = 2, cols = 4;
  OwnedTensor w(DType::bf16, Device::cpu, Shape{heads * head_dim, cols}), f(DType::f32, Device::cpu, Shape{heads});
  auto* bits = static_cast<uint16_t*>(w->raw());
  std::vector<uint16_t> before(static_cast<size_t>(w->numel()));
  for (int64_t i = 0; i < w->numel(); ++i) before[i] = bits[i] = float_to_bf16(0.1f * static_cast<float>(i) - 1.0f);
  f->data<float>()[0] = 1.0f, f->data<float>()[1] = 0.7f;
  ops::scale_head_rows(process_exec(), *w, *f, head_dim);
  for (int64_t r = 0; r < heads * head_dim; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t i = r * cols + c;
      EXPECT_EQ(bits[i], float_to_bf16(bf16_to_float(before[i]) * f->data<float>()[r / head_dim])) << i;
      if (r < head_dim) EXPECT_EQ(bits[i], before[i]) << "a factor of 1 changes nothing";
    }
}

Config small_config() {
  Config config;
  config.model.hidden = 256, config.model.layers = 2, config.model.heads = 4, config.model.kv_heads = 2;
  config.model.head_dim = 64, config.model.ffn_hidden = 512;
  return config;
}

// What `kiln plan` and the trainer's memory check count on the GPU: 2 bytes a 2-D weight
// instead of 4 (master) + 2 (compute copy); gains and biases stay fp32; the moments stay fp32.
TEST(Bf16Masters, PlanCountsTwoBytesPerWeight) {
  Config config = small_config();
  const MemoryBudget fp32 = plan_training_memory(config, Device::cuda);
  config.optim.master_weights = "bf16";
  const MemoryBudget bf16 = plan_training_memory(config, Device::cuda);
  const Model model(config.model, training_build_options(config, Device::cuda));
  int64_t matrices = 0, vectors = 0;
  for (const auto& p : model.parameters()) {
    (p->value().rank() == 2 ? matrices : vectors) += p->shape().numel();
    if (p->value().rank() == 2) EXPECT_EQ(p->value().dtype(), DType::bf16) << p->name();
  }
  std::printf("parameters: fp32 masters %zu bytes, bf16 masters %zu bytes (%lld 2-D, %lld 1-D elements)\n",
              fp32.parameters, bf16.parameters, static_cast<long long>(matrices), static_cast<long long>(vectors));
  const double slack = 512.0 * static_cast<double>(model.parameters().size());  // arena alignment
  EXPECT_NEAR(static_cast<double>(fp32.parameters), 6.0 * matrices + 4.0 * vectors, slack);
  EXPECT_NEAR(static_cast<double>(bf16.parameters), 2.0 * matrices + 4.0 * vectors, slack);
  EXPECT_EQ(bf16.optimizer, fp32.optimizer);
  EXPECT_EQ(bf16.gradients, fp32.gradients);
}

TEST(Bf16Masters, RefusedWhereItMakesNoSense) {
  Config config = small_config();
  config.optim.master_weights = "bf16";
  auto message = [&](Device device) {
    try {
      (void)training_build_options(config, device);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(message(Device::cpu).find("optim.master_weights"), std::string::npos) << message(Device::cpu);
  config.train.precision = "fp32";
  EXPECT_NE(message(Device::cuda).find("optim.master_weights"), std::string::npos);
  config.train.precision = "auto";
  EXPECT_EQ(message(Device::cuda), "");
  config.optim.adamw_state = "int8";
  EXPECT_THROW(plan_training_memory(config, Device::cuda), Error);
}

// A checkpoint of fp32 masters does not resume as bf16 masters, nor the other way: named.
TEST(Bf16Masters, ResumeAcrossTheSwitchIsRefusedByName) {
  Config saved = small_config(), now = small_config();
  now.optim.master_weights = "bf16";
  const std::vector<std::string> problems = incompatible_differences(saved, now);
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_NE(problems[0].find("optim.master_weights"), std::string::npos) << problems[0];
}

}  // namespace
}  // namespace kiln

// AdamW with bf16 and 8-bit moments (ops/optim/adamw_lowmem.h) on the CPU: the dynamic
// maps, the quantizer's round trip, updates against fp32-state AdamW, and short training
// runs whose loss follows fp32-state AdamW's. Resume of each format: test_resume.cpp.
#include "adamw_lowmem_fixture.h"
#include "fault_test_util.h"
#include "ops/optim/adamw.h"
#include "ops/optim/dynamic_map.h"
#include "model/model.h"
#include "train/memory_check.h"
#include "train/trainer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

namespace kiln {
namespace {

namespace am = adamw_lowmem;
using lowmem_test::LowMemSet;
using lowmem_test::step_of;

TEST(AdamWLowMemMap, SignedAndUnsignedMapsAreMonotoneWithZeroAndOne) {
  const ops::DynamicMap& s = ops::signed_dynamic_map();
  const ops::DynamicMap& u = ops::unsigned_dynamic_map();
  ASSERT_EQ(s.size(), 256u);
  ASSERT_EQ(u.size(), 256u);
  // Strictly increasing, but for the signed map's two zeros (+0 and -0: codes 127, 128).
  for (size_t i = 1; i < 256; ++i) {
    if (i == 128) EXPECT_EQ(s[i], s[i - 1]);
    else EXPECT_LT(s[i - 1], s[i]) << "signed code " << i;
    EXPECT_LT(u[i - 1], u[i]) << "unsigned code " << i;
  }
  EXPECT_EQ(s.front(), -1.0f);
  EXPECT_EQ(s.back(), 1.0f);
  EXPECT_EQ(s[127], 0.0f);
  EXPECT_EQ(s[128], 0.0f);
  EXPECT_EQ(u.front(), 0.0f);
  EXPECT_EQ(u.back(), 1.0f);
  EXPECT_FLOAT_EQ(s[129], 1e-6f);  // the smallest magnitudes: 7 (8) decades
  EXPECT_FLOAT_EQ(u[1], 1e-7f);
  // Symmetric: -x is a code whenever x is.
  for (size_t i = 0; i < 256; ++i) EXPECT_EQ(s[i], -s[255 - i]);
  // The top decade (0.1, 1] holds 64 signed and 128 unsigned codes, evenly spaced.
  EXPECT_EQ(std::count_if(s.begin(), s.end(), [](float x) { return x > 0.1f; }), 64);
  EXPECT_EQ(std::count_if(u.begin(), u.end(), [](float x) { return x > 0.1f; }), 128);
  EXPECT_NEAR(u[255] - u[254], 0.9 / 128, 1e-7);
  EXPECT_NEAR(s[255] - s[254], 0.9 / 64, 1e-7);
}

// Every code comes back as itself (the signed zeros as 128); any x in range comes back as
// the nearest code, so its error is at most half the gap around it: in decade z, (10^-(z+1),
// 10^-z], that is 0.45 10^-z / 2^k with k = 6 - z (signed) or 7 - z (unsigned) fraction
// bits, 0.45/64 = 7.0e-3 signed and 3.5e-3 unsigned in the top decade (0.1, 1]; the last
// decade has the one code 10^-z with 0 next below it, so half the smallest code there.
TEST(AdamWLowMemMap, QuantizeRoundTripIsTheNearestCode) {
  for (const bool is_signed : {true, false}) {
    SCOPED_TRACE(is_signed ? "signed" : "unsigned");
    const float* map = (is_signed ? ops::signed_dynamic_map() : ops::unsigned_dynamic_map()).data();
    for (int c = 0; c < 256; ++c) {
      const int back = am::nearest_code(map, map[c]);
      EXPECT_EQ(map[back], map[c]) << "code " << c;
      if (!(is_signed && c == 127)) EXPECT_EQ(back, c);
    }
    std::mt19937_64 rng(7);
    std::uniform_real_distribution<double> exponent(-8, 0), sign(-1, 1);
    double worst_top = 0;
    for (int trial = 0; trial < 200000; ++trial) {
      const double magnitude = std::pow(10.0, exponent(rng));
      const float x = static_cast<float>(is_signed && sign(rng) < 0 ? -magnitude : magnitude);
      const float got = map[am::nearest_code(map, x)];
      // No code is nearer.
      float best = std::abs(map[0] - x);
      for (int c = 1; c < 256; ++c) best = std::min(best, std::abs(map[c] - x));
      ASSERT_EQ(std::abs(got - x), best) << "x " << x;
      const int z = std::max(0, static_cast<int>(std::floor(-std::log10(std::abs(x)))));
      const int k = (is_signed ? 6 : 7) - z;
      if (k > 0) {
        const double bound = 0.45 * std::pow(10.0, -z) / std::pow(2.0, k) * (1 + 1e-5);
        ASSERT_LE(std::abs(got - x), bound) << "x " << x << " decade " << z;
      } else {  // the last decade holds one code, with 0 below it; and below that, only 0
        ASSERT_LE(std::abs(got - x), 0.5 * map[is_signed ? 129 : 1] * (1 + 1e-5)) << "below the smallest code";
      }
      if (z == 0) worst_top = std::max(worst_top, static_cast<double>(std::abs(got - x)));
    }
    EXPECT_LE(worst_top, (is_signed ? 0.45 / 64 : 0.45 / 128) * (1 + 1e-5));
    // Through a block's absmax: the largest element is exact, zeros stay zero.
    EXPECT_EQ(am::dequantize(map, am::quantize(map, 0.37f, 0.37f), 0.37f), 0.37f);
    EXPECT_EQ(am::dequantize(map, am::quantize(map, 0.0f, 0.0f), 0.0f), 0.0f);
    EXPECT_EQ(am::dequantize(map, am::quantize(map, 0.0f, 2.0f), 2.0f), 0.0f);
  }
}

// The fp32-state reference: the same tensors with fp32 moments through ops::adamw_update_all.
struct Fp32Set {
  std::vector<OwnedTensor> p, g, m, v;
  explicit Fp32Set(const LowMemSet& like) {
    for (size_t i = 0; i < like.p.size(); ++i) {
      OwnedTensor pc(DType::f32, Device::cpu, like.p[i]->shape());
      copy_tensor(*like.p[i], *pc);
      p.push_back(std::move(pc));
      g.push_back(OwnedTensor(DType::f32, Device::cpu, like.p[i]->shape()));
      m.push_back(LowMemSet::zeros(DType::f32, like.p[i]->shape()));
      v.push_back(LowMemSet::zeros(DType::f32, like.p[i]->shape()));
    }
  }
  void step(const LowMemSet& grads_from, const ops::AdamWStep& s, ops::AdamWDeviceTable& table) {
    std::vector<ops::AdamWTensor> list;
    for (size_t i = 0; i < p.size(); ++i) {
      copy_tensor(*grads_from.g[i], *g[i]);
      list.push_back({*p[i], *g[i], *m[i], *v[i], 0.1 * (i % 2)});
    }
    ops::adamw_update_all(process_exec(), list, s, table);
  }
};

// The parameters' change from `start` against the fp32 reference's: RMS of the difference
// over RMS of the reference change, over every tensor.
double relative_update_error(const LowMemSet& start, const LowMemSet& got, const Fp32Set& want) {
  double ss_err = 0, ss_ref = 0;
  for (size_t i = 0; i < got.p.size(); ++i)
    for (int64_t j = 0; j < got.p[i]->numel(); ++j) {
      const double p0 = start.p[i]->data<float>()[j];
      const double ref = want.p[i]->data<float>()[j] - p0, err = got.p[i]->data<float>()[j] - want.p[i]->data<float>()[j];
      ss_err += err * err, ss_ref += ref * ref;
    }
  return std::sqrt(ss_err / ss_ref);
}

// The first update from fresh state uses the moments before they are stored: the bits of
// fp32 AdamW's parameters (within an ulp: the fp32 CPU kernel may fuse multiply-adds).
// After 20 updates with fresh random gradients each step (no signal to follow, the
// harshest case for an average) the parameters' change stays within a fraction of fp32's:
// measured 2.2e-3 (bf16: each moment rounded to 2^-9 relative, its error damped by beta) and
// 1.5e-2 (int8: an element at 0.1 of its block's absmax keeps a code error of up to 7% of
// itself, less near the absmax), checked at 1e-2 and 1e-1: 4.5x and 6.5x the measured.
TEST(AdamWLowMem, UpdatesFollowFp32StateAdamW) {
  for (const auto state : {ops::AdamWState::bf16, ops::AdamWState::int8}) {
    const bool int8 = state == ops::AdamWState::int8;
    SCOPED_TRACE(int8 ? "int8" : "bf16");
    const std::vector<Shape> shapes = {Shape{64, 96}, Shape{3, 5001}, Shape{257}};
    LowMemSet set(state, shapes, 11);
    const LowMemSet start(set, Device::cpu);
    Fp32Set ref(set);
    ops::AdamWLowMemDeviceTable table;
    ops::AdamWDeviceTable ref_table;
    ops::adamw_lowmem_update_all(process_exec(), state, set.list(), step_of(1), table);
    ref.step(set, step_of(1), ref_table);
    for (size_t i = 0; i < shapes.size(); ++i)
      for (int64_t j = 0; j < set.p[i]->numel(); ++j)
        ASSERT_NEAR(set.p[i]->data<float>()[j], ref.p[i]->data<float>()[j],
                    2.5e-7 * std::abs(ref.p[i]->data<float>()[j]) + 2e-9)
            << "tensor " << i << " element " << j;
    for (int64_t t = 2; t <= 20; ++t) {
      set.regrad(1000 * t);
      ops::adamw_lowmem_update_all(process_exec(), state, set.list(), step_of(t), table);
      ref.step(set, step_of(t), ref_table);
    }
    const double err = relative_update_error(start, set, ref);
    std::printf("adamw %s moments: the parameters' change after 20 updates differs from fp32 state's by %.3e (rms)\n",
                int8 ? "int8" : "bf16", err);
    ::testing::Test::RecordProperty(int8 ? "int8_update_error" : "bf16_update_error", err);
    EXPECT_LT(err, int8 ? 1e-1 : 1e-2);
  }
}

// The CPU loop is deterministic: two runs give the same bits, threads or not.
TEST(AdamWLowMem, StepsAreReproducible) {
  for (const auto state : {ops::AdamWState::bf16, ops::AdamWState::int8}) {
    LowMemSet a(state, lowmem_test::mixed_shapes(), 5), b(state, lowmem_test::mixed_shapes(), 5);
    ops::AdamWLowMemDeviceTable ta, tb;
    for (int64_t t = 1; t <= 3; ++t) {
      a.regrad(77 * t), b.regrad(77 * t);
      ops::adamw_lowmem_update_all(process_exec(), state, a.list(), step_of(t), ta);
      ops::adamw_lowmem_update_all(process_exec(), state, b.list(), step_of(t), tb);
    }
    EXPECT_TRUE(a.state_bytes() == b.state_bytes());
  }
}

TEST(AdamWLowMem, MismatchedStateIsRefused) {
  LowMemSet set(ops::AdamWState::bf16, {Shape{8}}, 1);
  ops::AdamWLowMemDeviceTable table;
  EXPECT_THROW(ops::adamw_lowmem_update_all(process_exec(), ops::AdamWState::int8, set.list(), step_of(1), table), Error);
  EXPECT_THROW(ops::adamw_state_from_name("fp8"), Error);
}

// The planned optimizer state (what `kiln plan` and the memory check print): bf16 half of
// fp32's; int8 a quarter plus 8 bytes of absmax per 256 elements of the 8-bit tensors,
// plus the fp32 moments of the tensors under 4096 elements, counted here exactly.
TEST(AdamWLowMem, PlannedStateShrinksAsExpected) {
  Config config;
  config.model.hidden = 256, config.model.layers = 2, config.model.heads = 4, config.model.kv_heads = 2;
  config.model.head_dim = 64, config.model.ffn_hidden = 512;
  auto planned = [&](const std::string& state) {
    config.optim.adamw_state = state;
    return plan_training_memory(config, Device::cpu).optimizer;
  };
  const size_t fp32 = planned("fp32"), bf16 = planned("bf16"), int8 = planned("int8");
  const Model model(config.model, training_build_options(config, Device::cpu));
  int64_t big = 0, small = 0, absmax_blocks = 0;
  for (const auto& p : model.parameters()) {
    if (!p->trainable()) continue;
    const int64_t n = p->shape().numel();
    if (n >= am::kMinQuantizedNumel) big += n, absmax_blocks += am::blocks_of(n);
    else small += n;
  }
  std::printf("optimizer state: fp32 %zu, bf16 %zu, int8 %zu bytes (%lld of %lld elements 8-bit)\n", fp32, bf16, int8,
              static_cast<long long>(big), static_cast<long long>(big + small));
  // The arena aligns each tensor: allow 256 bytes a tensor.
  const size_t slack = 4 * 256 * model.parameters().size();
  EXPECT_NEAR(static_cast<double>(fp32), 8.0 * static_cast<double>(big + small), static_cast<double>(slack));
  EXPECT_NEAR(static_cast<double>(bf16), 4.0 * static_cast<double>(big + small), static_cast<double>(slack));
  EXPECT_NEAR(static_cast<double>(int8), 2.0 * big + 8.0 * small + 8.0 * absmax_blocks, static_cast<double>(slack));
  EXPECT_LT(int8, fp32 / 3);
}

// Short training runs of the kiln binary, one per format and data seed, against fp32
// state: the mean loss of the last 10 steps (of 60), averaged over three data seeds, within
// 3% of fp32's. One seed's gap moves with the batches it happens to see (int8 measured
// +0.39% on one stream and +2.40% on the same stream cut differently after epoch 0); over
// the three seeds bf16 measured -0.29% and int8 +0.20%. 3% is far below what a format that stopped
// learning would show (the loss falls from ln 256 = 5.5 to 2.1 in these 60 steps; fp32
// must reach 0.8 of its first loss). Dimensions of 64 so the matrices (4096 elements and
// more) are 8-bit under int8.
TEST(AdamWLowMem, ShortTrainingRunFollowsFp32State) {
  const std::string dir = test::temp_dir("kiln-adamw-lowmem");
  const std::string corpus = test::write_tiny_corpus(dir, 80);
  const std::string shape =
      " --set model.hidden=64 --set model.heads=4 --set model.kv_heads=2 --set model.ffn_hidden=128"
      " --set train.steps=60 --set checkpoint.every=0 --set optim.warmup_steps=6";
  auto tail_loss = [&](const std::string& state, int seed) {
    std::string output;
    const std::string out = dir + "/" + state + "-" + std::to_string(seed);
    const std::string set = shape + " --set optim.adamw_state=" + state + " --set data.seed=" + std::to_string(seed);
    EXPECT_EQ(test::run_with_fault(test::tiny_train(corpus, out, set), "", &output), 0) << output;
    const auto records = test::train_records(out);
    EXPECT_EQ(records.size(), 60u);
    double sum = 0;
    for (size_t i = records.size() - 10; i < records.size(); ++i) sum += records[i].loss.get<double>();
    return std::pair{sum / 10, records.front().loss.get<double>()};
  };
  constexpr int kSeeds = 3;
  double fp32 = 0;
  for (int seed = 1; seed <= kSeeds; ++seed) {
    const auto [tail, first] = tail_loss("fp32", seed);
    EXPECT_LT(tail, 0.8 * first) << "the fp32 run did not learn (data seed " << seed << ")";
    fp32 += tail / kSeeds;
  }
  for (const std::string state : {"bf16", "int8"}) {
    double loss = 0;
    for (int seed = 1; seed <= kSeeds; ++seed) loss += tail_loss(state, seed).first / kSeeds;
    const double gap = (loss - fp32) / fp32;
    std::printf("adamw_state %s: loss of the last 10 steps %.5f, fp32 state %.5f (mean of %d data seeds), gap %+.3f%%\n",
                state.c_str(), loss, fp32, kSeeds, 100 * gap);
    ::testing::Test::RecordProperty(state + "_loss_gap", gap);
    EXPECT_LT(std::abs(gap), 0.03) << state;
  }
  if (!::testing::Test::HasFailure()) std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kiln

// Op properties that are not a comparison with a reference (the op table, test_op_table,
// checks those): errors that name the bad argument, the RoPE tables' convention, attention
// never crossing documents, the fused q/k preparation giving the unfused ops' bits, and the
// CPU path's vector exp (ops/cpu_exp.h) within an ulp of the exact value.
#include "grad_check.h"
#include "ops/attention/attention.h"
#include "ops/attention/qkv_prepare.h"
#include "ops/cpu_exp.h"
#include "ops/layer_norm/layer_norm.h"
#include "ops/rms_norm/rms_norm.h"
#include "ops/rope/rope.h"
#include "ops/split/qkv_split.h"
#include "test_util.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <tuple>

namespace kiln {
namespace {

using namespace kiln::test;

double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double m = a.size() == b.size() ? 0 : INFINITY;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

std::vector<double> concat(std::vector<double> a, const std::vector<double>& b, const std::vector<double>& c) {
  a.insert(a.end(), b.begin(), b.end());
  a.insert(a.end(), c.begin(), c.end());
  return a;
}

struct RopeTables {
  OwnedTensor cos, sin;
  RopeTables(double theta, int64_t head_dim, int64_t max_pos, DType dtype)
      : cos(dtype, Device::cpu, Shape{max_pos, head_dim / 2}), sin(dtype, Device::cpu, Shape{max_pos, head_dim / 2}) {
    ops::rope_fill_tables(process_exec(), ops::rope_inverse_frequencies(theta, head_dim), *cos, *sin);
  }
};

TEST(OpsProperties, RmsNormRefusesADxCopyOfTheWrongShapeByName) {
  OwnedTensor x = random_f64(Shape{6, 7}, 30), w = random_f64(Shape{7}, 31), dy = random_f64(Shape{6, 7}, 32);
  OwnedTensor y = nan_f64(Shape{6, 7}), rstd = nan_f64(Shape{6}), dx = nan_f64(Shape{6, 7});
  ops::rms_norm_forward(process_exec(), *x, *w, 1e-5, *y, *rstd);
  OwnedTensor short_copy = nan_f64(Shape{5, 7});
  const std::string error =
      test::error_of([&] { ops::rms_norm_backward(process_exec(), *x, *w, *rstd, *dy, *dx, Tensor(), false, *short_copy); });
  EXPECT_NE(error.find("dx_copy"), std::string::npos) << error;
}

// The tables as transformers builds them: inv_freq_j = 1 / theta^(2j / D) and angle =
// fp32(pos * inv_freq_j), rotate_half pairing (j, j + D/2); the inverse undoes it.
TEST(OpsProperties, RopeTablesFollowTheTransformersConvention) {
  const std::vector<int32_t> pos = {0, 1, 2, 0, 1, 2, 3, 4, 15, 0, 7};
  const int64_t n = static_cast<int64_t>(pos.size()), heads = 3, max_pos = 16;
  OwnedTensor positions = i32_tensor(pos);
  for (int64_t d : {8, 6})
    for (double theta : {10000.0, 7.0}) {
      SCOPED_TRACE(fmt::format("head_dim {} theta {}", d, theta));
      RopeTables t(theta, d, max_pos, DType::f64);
      OwnedTensor x = random_f64(Shape{n, heads, d}, 40), y = copy_of(*x);
      ops::rope_apply(process_exec(), *y, *positions, *t.cos, *t.sin, false);
      const std::vector<float> inv = ops::rope_inverse_frequencies(theta, d);
      const int64_t half = d / 2;
      double worst = 0;
      for (int64_t i = 0; i < n; ++i)
        for (int64_t h = 0; h < heads; ++h)
          for (int64_t j = 0; j < half; ++j) {
            const double expected_inv = std::pow(theta, -2.0 * static_cast<double>(j) / static_cast<double>(d));
            EXPECT_NEAR(inv[static_cast<size_t>(j)], expected_inv, 1e-6 * expected_inv);
            const double a = static_cast<float>(pos[static_cast<size_t>(i)]) * inv[static_cast<size_t>(j)];
            const double* xi = x->data<double>() + (i * heads + h) * d;
            const double* yi = y->data<double>() + (i * heads + h) * d;
            worst = std::max(worst, std::abs(yi[j] - (xi[j] * std::cos(a) - xi[j + half] * std::sin(a))));
            worst = std::max(worst, std::abs(yi[j + half] - (xi[j + half] * std::cos(a) + xi[j] * std::sin(a))));
          }
      EXPECT_LT(worst, 1e-14);
      EXPECT_GT(max_abs_diff(values_of(*y), values_of(*x)), 1e-2);  // it did rotate
      // On f64 tables the inverse undoes the rotation to rounding (the op table's cases use
      // fp32-rounded tables, where cos^2 + sin^2 is 1 only within 2^-23).
      ops::rope_apply(process_exec(), *y, *positions, *t.cos, *t.sin, true);
      EXPECT_LT(max_abs_diff(values_of(*y), values_of(*x)), 1e-14);
    }
}

TEST(OpsProperties, AttentionNeverCrossesDocuments) {
  // Changing document 0's keys/values must leave document 1's outputs bitwise unchanged.
  const std::vector<int32_t> cu = {0, 5, 11};
  OwnedTensor cu_t = i32_tensor(cu);
  OwnedTensor q = random_f64(Shape{11, 2, 4}, 60), k = random_f64(Shape{11, 1, 4}, 61), v = random_f64(Shape{11, 1, 4}, 62);
  OwnedTensor out = nan_f64(q->shape()), lse = nan_f64(Shape{11, 2});
  ops::attention_forward(process_exec(), *q, *k, *v, *cu_t, {}, *out, *lse);
  const std::vector<double> before = values_of(out->rows(5, 11));
  for (int64_t i = 0; i < 5 * 4; ++i) k->data<double>()[i] += 3, v->data<double>()[i] -= 2;
  ops::attention_forward(process_exec(), *q, *k, *v, *cu_t, {}, *out, *lse);
  EXPECT_EQ(max_abs_diff(values_of(out->rows(5, 11)), before), 0.0);
}

// The fused preparation gives the numbers of the unfused ops it replaces, to the bit:
// split, per-head RMSNorm, rotation.
TEST(OpsProperties, QkvPrepareGivesTheUnfusedOpsBits) {
  const std::vector<int32_t> pos = {0, 1, 2, 0, 1, 5, 3};  // restarting, as packed
  const int64_t n = static_cast<int64_t>(pos.size()), hq = 4, hkv = 2, d = 6, cols = (hq + 2 * hkv) * d;
  const double eps = 1e-5;
  OwnedTensor positions = i32_tensor(pos);
  RopeTables t(10000.0, d, 8, DType::f64);
  for (auto [norm, rope] : {std::pair{true, true}, {true, false}, {false, true}, {false, false}}) {
    SCOPED_TRACE(fmt::format("norm {} rope {}", norm, rope));
    OwnedTensor qkv = random_f64(Shape{n, cols}, 90, 1.5);
    OwnedTensor q_gain = random_f64(Shape{d}, 91, 0.3), k_gain = random_f64(Shape{d}, 92, 0.3);
    for (int64_t c = 0; c < d; ++c) q_gain->data<double>()[c] += 1.0, k_gain->data<double>()[c] += 1.0;
    ops::QkvPrepare p;
    p.q_heads = hq, p.kv_heads = hkv, p.head_dim = d, p.eps = eps;
    if (norm) p.q_gain = *q_gain, p.k_gain = *k_gain;
    if (rope) p.cos = *t.cos, p.sin = *t.sin, p.positions = *positions;
    OwnedTensor q = nan_f64(Shape{n, hq, d}), k = nan_f64(Shape{n, hkv, d}), v = nan_f64(Shape{n, hkv, d});
    ops::qkv_prepare_forward(process_exec(), *qkv, p, *q, *k, *v);

    OwnedTensor sq = nan_f64(q->shape()), sk = nan_f64(k->shape()), sv = nan_f64(v->shape());
    ops::qkv_split(process_exec(), *qkv, *sq, *sk, *sv);
    for (auto [part, gain, heads] : {std::tuple{&sq, &q_gain, hq}, {&sk, &k_gain, hkv}}) {
      OwnedTensor& x = *part;
      if (norm) {
        OwnedTensor normed = nan_f64(x->shape()), rstd = nan_f64(Shape{n * heads});
        ops::rms_norm_forward(process_exec(), x->view(Shape{n * heads, d}), **gain, eps, normed->view(Shape{n * heads, d}), *rstd);
        x = std::move(normed);
      }
      if (rope) ops::rope_apply(process_exec(), *x, *positions, *t.cos, *t.sin, false);
    }
    EXPECT_EQ(max_abs_diff(concat(values_of(*q), values_of(*k), values_of(*v)),
                           concat(values_of(*sq), values_of(*sk), values_of(*sv))),
              0.0);
  }
}

TEST(OpsProperties, QkvPrepareRejectsBadInput) {
  OwnedTensor qkv = random_f64(Shape{3, 4 * 4}, 98), q = nan_f64(Shape{3, 2, 4}), k = nan_f64(Shape{3, 1, 4}),
              v = nan_f64(Shape{3, 1, 4});
  ops::QkvPrepare p;
  p.q_heads = 2, p.kv_heads = 1, p.head_dim = 4;
  RopeTables t(10000.0, 4, 2, DType::f64);
  OwnedTensor far = i32_tensor({0, 1, 2});  // 2 is outside a table of 2 positions
  p.cos = *t.cos, p.sin = *t.sin, p.positions = *far;
  EXPECT_THROW(ops::qkv_prepare_forward(process_exec(), *qkv, p, *q, *k, *v), Error);
  OwnedTensor near = i32_tensor({0, 1, 1});
  p.positions = *near;
  ops::qkv_prepare_forward(process_exec(), *qkv, p, *q, *k, *v);
  p.head_dim = 3;  // odd, and no longer fits qkv
  EXPECT_THROW(ops::qkv_prepare_forward(process_exec(), *qkv, p, *q, *k, *v), Error);
}

// The vector exp of the CPU softmax and SwiGLU: every 512th float from -87.33 to 88.37
// (each binade sampled alike, 4.4M values) within 1.01 float ulp of the double exp; 0
// below that range, +inf above, NaN kept; and a value's result the same in every lane and
// in a block's partial last group.
TEST(OpsProperties, CpuExpIsWithinAnUlpOfTheExactValue) {
  constexpr float kMin = -87.3365478515625f, kMax = 88.3762626647949f;
  double worst = 0;
  float worst_at = 0;
  size_t count = 0;
  std::vector<float> x, y;
  auto check = [&] {  // a chunk of values
    y = x;
    cpu::exp_shifted(y.data(), static_cast<int64_t>(y.size()), 0.0f);
    for (size_t i = 0; i < x.size(); ++i) {
      const double exact = std::exp(static_cast<double>(x[i]));
      const double ulp = std::ldexp(1.0, std::max(std::ilogb(static_cast<float>(exact)), -126) - 23);
      const double err = std::abs(static_cast<double>(y[i]) - exact) / ulp;
      if (!(err <= worst)) worst = err, worst_at = x[i];
    }
    count += x.size();
    x.clear();
  };
  for (uint32_t bits = 0; bits < 0x7f800000u; bits += 512) {
    const float v = std::bit_cast<float>(bits);
    if (v <= kMax) x.push_back(v);
    if (-v >= kMin) x.push_back(-v);
    if (x.size() >= 4096) check();
  }
  check();
  std::printf("cpu exp: %zu values, worst %.3f ulp at %.9g\n", count, worst, worst_at);
  EXPECT_LT(worst, 1.01) << "at " << worst_at;

  std::vector<float> special = {-INFINITY, -1000.0f, -87.5f, INFINITY, 1000.0f, 88.5f, NAN, 0.0f, -0.0f};
  cpu::exp_shifted(special.data(), static_cast<int64_t>(special.size()), 0.0f);
  EXPECT_EQ(special[0], 0.0f);
  EXPECT_EQ(special[1], 0.0f);
  EXPECT_EQ(special[2], 0.0f);
  EXPECT_EQ(special[3], INFINITY);
  EXPECT_EQ(special[4], INFINITY);
  EXPECT_EQ(special[5], INFINITY);
  EXPECT_TRUE(std::isnan(special[6]));
  EXPECT_EQ(special[7], 1.0f);
  EXPECT_EQ(special[8], 1.0f);

  // One value at each position of blocks of 1 to 19: the same bits everywhere, and the
  // same as exp_negated of its negation.
  const float v = -3.14159f;
  float one = v;
  cpu::exp_shifted(&one, 1, 0.0f);
  for (int64_t n = 1; n < 20; ++n)
    for (int64_t at = 0; at < n; ++at) {
      std::vector<float> block(static_cast<size_t>(n), 0.5f), negated(static_cast<size_t>(n), -0.5f);
      block[static_cast<size_t>(at)] = v;
      negated[static_cast<size_t>(at)] = -v;
      cpu::exp_shifted(block.data(), n, 0.0f);
      cpu::exp_negated(negated.data(), negated.data(), n);
      EXPECT_EQ(std::bit_cast<uint32_t>(block[static_cast<size_t>(at)]), std::bit_cast<uint32_t>(one)) << n << " " << at;
      EXPECT_EQ(std::bit_cast<uint32_t>(negated[static_cast<size_t>(at)]), std::bit_cast<uint32_t>(one)) << n << " " << at;
    }
}

}  // namespace
}  // namespace kiln

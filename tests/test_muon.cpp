// Muon's numerical core on the CPU (ops/optim/muon.h): the Newton-Schulz iteration acts on
// each singular value as the scalar quintic does, the momentum and Nesterov forms as
// defined, weight decay alone on a zero gradient, the gradient factor, and the errors.
#include "muon_reference.h"
#include "ops/optim/muon.h"
#include "test_util.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <utility>
#include <cstring>
#include <vector>

namespace kiln {
namespace {

using muon_test::singular_values;

std::vector<double> values_of(const Tensor& t) {
  std::vector<double> v(static_cast<size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i)
    v[static_cast<size_t>(i)] = t.dtype() == DType::f64 ? t.data<double>()[i] : t.data<float>()[i];
  return v;
}

OwnedTensor copy_of(const Tensor& t) {
  OwnedTensor c(t.dtype(), Device::cpu, t.shape());
  copy_tensor(t, *c);
  return c;
}

OwnedTensor as_f32(const Tensor& f64) {
  OwnedTensor out(DType::f32, Device::cpu, f64.shape());
  for (int64_t i = 0; i < f64.numel(); ++i) out->data<float>()[i] = static_cast<float>(f64.data<double>()[i]);
  return out;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

double max_abs_diff(const Tensor& a, const Tensor& b) {
  const std::vector<double> x = values_of(a), y = values_of(b);
  double m = 0;
  for (size_t i = 0; i < x.size(); ++i) m = std::max(m, std::abs(x[i] - y[i]));
  return m;
}

// 1. For random wide and tall matrices, the output's singular values are the quintic's
// iterates of the input's normalized ones (f64: to 1e-12; measured 5e-15 to 1.6e-13), and
// all lie in the band of the quintic over [the smallest normalized input, 1]. The Gaussian
// inputs' normalized singular values span [0.059, 0.37], a third input with columns scaled
// over three decades [0.0035, 0.55]; the quintic's five-step band over [0.059, 1] is
// [0.6818, 1.1344], over [0.0035, 1] [0.6818, 1.2024] (within [0.6, 1.25], checked); the
// outputs measured [0.6820, 1.1327], [0.6826, 1.1302] and [0.6821, 1.2021]. f32 gives the
// f64 result within 5e-6 (measured 4.4e-7 to 6.2e-7; the outputs' elements are about 0.15).
TEST(Muon, NewtonSchulzActsOnEachSingularValueAsTheQuintic) {
  const int steps = 5;
  const double eps = 1e-7;
  for (const auto& [shape, spread] : {std::pair{Shape{24, 40}, false}, std::pair{Shape{40, 24}, false},
                                      std::pair{Shape{24, 40}, true}}) {
    SCOPED_TRACE(shape.str() + (spread ? " spread" : ""));
    const int64_t rows = shape[0], cols = shape[1];
    const OwnedTensor input = test::random_tensor(DType::f64, shape, 11 + static_cast<uint64_t>(rows));
    if (spread)  // column j scaled by 10^(-3 j / cols): singular values over three decades
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < cols; ++j)
          input->data<double>()[i * cols + j] *= std::pow(10.0, -3.0 * static_cast<double>(j) / cols);
    const std::vector<double> x0 = values_of(*input);
    double norm = 0;
    for (double v : x0) norm += v * v;
    norm = std::sqrt(norm);
    const std::vector<double> s_in = singular_values(x0, rows, cols);

    OwnedTensor x = copy_of(*input);
    ops::newton_schulz(process_exec(), *x, steps, eps);
    const std::vector<double> s_out = singular_values(values_of(*x), rows, cols);

    // The quintic is not monotone: sort the predictions before pairing them.
    std::vector<double> predicted;
    for (double s : s_in) predicted.push_back(muon_test::quintic(s / (norm + eps), steps));
    std::sort(predicted.begin(), predicted.end(), std::greater<>());
    ASSERT_EQ(predicted.size(), s_out.size());
    double worst = 0;
    for (size_t i = 0; i < s_out.size(); ++i) worst = std::max(worst, std::abs(s_out[i] - predicted[i]));
    EXPECT_LT(worst, 1e-12);

    const double lo = s_in.back() / (norm + eps);
    const auto [band_lo, band_hi] = muon_test::quintic_band(lo, steps);
    EXPECT_GT(band_lo, 0.6);
    EXPECT_LT(band_hi, 1.25);
    for (double s : s_out) {
      EXPECT_GE(s, band_lo - 1e-12);
      EXPECT_LE(s, band_hi + 1e-12);
    }

    OwnedTensor x32 = as_f32(*input);
    ops::newton_schulz(process_exec(), *x32, steps, eps);
    const double f32_error = max_abs_diff(*x32, *x);
    EXPECT_LT(f32_error, 5e-6);
    ::testing::Test::RecordProperty(
        "band_" + std::to_string(rows) + "x" + std::to_string(cols) + (spread ? "_spread" : ""),
        fmt::format("in [{:.4f}, {:.4f}] -> out [{:.4f}, {:.4f}], quintic band [{:.4f}, {:.4f}], worst |out - "
                    "predicted| {:.2e}, f32 max error {:.2e}",
                    lo, s_in.front() / norm, s_out.back(), s_out.front(), band_lo, band_hi, worst, f32_error));
  }
}

// A tiny f64 problem: per matrix P, G1, G2, and the update's own settings.
struct Problem {
  std::vector<Shape> shapes{Shape{6, 10}, Shape{9, 5}};
  std::vector<OwnedTensor> p, g1, g2, m;
  double lr = 0.02, wd = 0.1;
  std::vector<double> scale{1.0, 1.5};

  explicit Problem(DType dtype = DType::f64) {
    uint64_t seed = 500;
    for (const Shape& s : shapes) {
      const OwnedTensor p64 = test::random_tensor(DType::f64, s, ++seed);
      const OwnedTensor g164 = test::random_tensor(DType::f64, s, ++seed);
      const OwnedTensor g264 = test::random_tensor(DType::f64, s, ++seed);
      p.push_back(dtype == DType::f64 ? copy_of(*p64) : as_f32(*p64));
      g1.push_back(dtype == DType::f64 ? copy_of(*g164) : as_f32(*g164));
      g2.push_back(dtype == DType::f64 ? copy_of(*g264) : as_f32(*g264));
      m.emplace_back(dtype, Device::cpu, s);
      zero_tensor(*m.back());
    }
  }
  std::vector<ops::MuonMatrix> matrices(const std::vector<OwnedTensor>& grads) const {
    std::vector<ops::MuonMatrix> list;
    for (size_t i = 0; i < shapes.size(); ++i) list.push_back({*p[i], *grads[i], *m[i], wd, scale[i]});
    return list;
  }
};

// 2. From zero, the buffer is g (plain) or (1 - mu) g (ema) after one step, and
// mu M + g / mu M + (1 - mu) g after two; the parameters after two steps are the update
// formula applied to U computed by hand (g + mu M, (1 - mu) g + mu M, or M) and
// orthogonalized by newton_schulz; Nesterov changes the update.
TEST(Muon, MomentumAndNesterovFollowTheirDefinitions) {
  std::vector<std::vector<double>> params_by_form;
  for (const bool ema : {false, true})
    for (const bool nesterov : {false, true}) {
      SCOPED_TRACE(fmt::format("ema {} nesterov {}", ema, nesterov));
      ops::MuonSettings settings;
      settings.ema = ema;
      settings.nesterov = nesterov;
      const double mu = settings.momentum;
      Problem pr;
      ops::MuonUpdate update(settings, pr.shapes, Device::cpu);
      Arena arena("muon", Device::cpu);
      update.plan(arena);
      EXPECT_EQ(update.planned_bytes(), 0u);

      // The expected state, by hand in double.
      std::vector<std::vector<double>> p(pr.shapes.size()), m(pr.shapes.size());
      for (size_t i = 0; i < pr.shapes.size(); ++i) {
        p[i] = values_of(*pr.p[i]);
        m[i].assign(p[i].size(), 0.0);
      }
      for (const auto* grads : {&pr.g1, &pr.g2}) {
        update.step(process_exec(), pr.matrices(*grads), pr.lr);
        for (size_t i = 0; i < pr.shapes.size(); ++i) {
          const std::vector<double> g = values_of(*(*grads)[i]);
          OwnedTensor u(DType::f64, Device::cpu, pr.shapes[i]);
          for (size_t j = 0; j < g.size(); ++j) {
            m[i][j] = ema ? mu * m[i][j] + (1 - mu) * g[j] : mu * m[i][j] + g[j];
            u->data<double>()[j] = !nesterov ? m[i][j] : ema ? (1 - mu) * g[j] + mu * m[i][j] : g[j] + mu * m[i][j];
          }
          ops::newton_schulz(process_exec(), *u, settings.ns_steps, settings.ns_eps);
          const double decay = 1 - pr.lr * pr.wd;
          for (size_t j = 0; j < g.size(); ++j) p[i][j] = p[i][j] * decay - pr.lr * pr.scale[i] * u->data<double>()[j];
          const std::vector<double> got_m = values_of(*pr.m[i]), got_p = values_of(*pr.p[i]);
          for (size_t j = 0; j < g.size(); ++j) {
            EXPECT_DOUBLE_EQ(got_m[j], m[i][j]) << "momentum of matrix " << i << " element " << j;
            EXPECT_NEAR(got_p[j], p[i][j], 1e-13) << "param of matrix " << i << " element " << j;
          }
        }
        if (grads == &pr.g1)  // after one step from zero: exactly g or (1 - mu) g
          for (size_t i = 0; i < pr.shapes.size(); ++i) {
            const std::vector<double> g = values_of(*pr.g1[i]), got = values_of(*pr.m[i]);
            for (size_t j = 0; j < g.size(); ++j) ASSERT_EQ(got[j], ema ? (1 - mu) * g[j] : g[j]);
          }
      }
      params_by_form.push_back(values_of(*pr.p[0]));
    }
  // Nesterov on or off changes the update, in either form of the buffer.
  EXPECT_GT(std::abs(params_by_form[0][0] - params_by_form[1][0]), 1e-6);
  EXPECT_GT(std::abs(params_by_form[2][0] - params_by_form[3][0]), 1e-6);
}

// 3. A zero gradient leaves a zero buffer and a zero orthogonalized update: only the
// decay acts, P = P (1 - lr wd) bit for bit, in f64 and f32.
TEST(Muon, ZeroGradientOnlyDecays) {
  for (const DType dtype : {DType::f64, DType::f32}) {
    SCOPED_TRACE(dtype_name(dtype));
    Problem pr(dtype);
    for (auto& g : pr.g1) zero_tensor(*g);
    ops::MuonUpdate update({}, pr.shapes, Device::cpu);
    std::vector<OwnedTensor> before;
    for (const auto& p : pr.p) before.push_back(copy_of(*p));
    update.step(process_exec(), pr.matrices(pr.g1), pr.lr);
    for (size_t i = 0; i < pr.shapes.size(); ++i) {
      OwnedTensor expected = copy_of(*before[i]);
      for (int64_t j = 0; j < expected->numel(); ++j) {
        if (dtype == DType::f64)
          expected->data<double>()[j] *= 1.0 - pr.lr * pr.wd;
        else
          expected->data<float>()[j] *= static_cast<float>(1.0 - pr.lr * pr.wd);
      }
      EXPECT_TRUE(same_bits(*pr.p[i], *expected)) << "param " << i;
      for (double v : values_of(*pr.m[i])) ASSERT_EQ(v, 0.0);
    }
  }
}

// 4. A step with grad_scale s on G equals a step with s G and grad_scale 1.
TEST(Muon, GradScaleEqualsPrescaledGradients) {
  const double s = 0.37;
  Problem a, b;
  for (auto& g : b.g1)
    for (int64_t j = 0; j < g->numel(); ++j) g->data<double>()[j] *= s;
  ops::MuonUpdate ua({}, a.shapes, Device::cpu), ub({}, b.shapes, Device::cpu);
  ua.step(process_exec(), a.matrices(a.g1), a.lr, s);
  ub.step(process_exec(), b.matrices(b.g1), b.lr, 1.0);
  for (size_t i = 0; i < a.shapes.size(); ++i) {
    EXPECT_LT(max_abs_diff(*a.p[i], *b.p[i]), 1e-12) << "param " << i;
    EXPECT_LT(max_abs_diff(*a.m[i], *b.m[i]), 1e-12) << "momentum " << i;
  }
}

// The update refuses a list that does not match its shapes, mixed dtypes, and bad settings,
// each with one line naming the op.
TEST(Muon, ErrorsNameTheOp) {
  Problem pr;
  ops::MuonUpdate update({}, pr.shapes, Device::cpu);
  auto list = pr.matrices(pr.g1);
  list.pop_back();
  EXPECT_NE(test::error_of([&] { update.step(process_exec(), list, 0.1); }).find("[muon] 1 matrices given, 2 planned"),
            std::string::npos);
  list = pr.matrices(pr.g1);
  std::swap(list[0], list[1]);
  EXPECT_NE(test::error_of([&] { update.step(process_exec(), list, 0.1); }).find("[muon] matrix 0: param must be [6, 10]"),
            std::string::npos);
  list = pr.matrices(pr.g1);
  OwnedTensor g32 = as_f32(*pr.g1[0]);
  list[0].grad = *g32;
  EXPECT_NE(test::error_of([&] { update.step(process_exec(), list, 0.1); }).find("[muon] grad must be f64@cpu"), std::string::npos);
  ops::MuonSettings bad;
  bad.momentum = 1.0;
  EXPECT_NE(test::error_of([&] { ops::MuonUpdate u(bad, pr.shapes, Device::cpu); }).find("[muon] momentum"),
            std::string::npos);
  EXPECT_NE(test::error_of([&] { ops::MuonUpdate u({}, {Shape{4}}, Device::cpu); }).find("[muon] matrix 0"),
            std::string::npos);
  OwnedTensor v(DType::f64, Device::cpu, Shape{5});
  EXPECT_NE(test::error_of([&] { ops::newton_schulz(process_exec(), *v, 5); }).find("[newton_schulz] x must have rank 2"),
            std::string::npos);
}

// The GPU workspace: a bucket is cut into batches of at most 64 matrices or about 1 GiB.
TEST(Muon, BatchCapacityBoundsTheWorkspace) {
  EXPECT_EQ(ops::MuonUpdate::batch_capacity(64, 64), 64);
  // [4096, 14336]: two 4096 x 14336 bf16 iterates and two 4096^2 Gram buffers, 288 MiB.
  EXPECT_EQ(ops::MuonUpdate::batch_workspace_bytes(4096, 14336, 1), size_t{2} * (2 * 4096 * 14336 + 2 * 4096 * 4096));
  EXPECT_EQ(ops::MuonUpdate::batch_capacity(4096, 14336), 3);
  EXPECT_EQ(ops::MuonUpdate::batch_capacity(32768, 32768), 1);  // never below one
  // Slots padded to 128 elements: [3, 5] takes 128 for X and 128 for its 3 x 3 Gram.
  EXPECT_EQ(ops::MuonUpdate::batch_workspace_bytes(3, 5, 2), size_t{2} * 2 * (2 * 128 + 2 * 128));
}

}  // namespace
}  // namespace kiln

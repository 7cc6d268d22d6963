// The short convolution of KDA (ops/short_conv) on the CPU: its definition on a hand case
// (documents restart: no input crosses a boundary), dx and dw against central finite
// differences in f64 (five-point stencil, L = sum(y * R)), and decode's step, row by row
// from a per-slot state, equal to the full forward over each document.
#include "grad_check.h"
#include "ops/short_conv/short_conv.h"
#include "test_util.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

namespace kiln {
namespace {

using namespace kiln::test;

double silu(double z) { return z / (1 + std::exp(-z)); }

TEST(ShortConv, IsCausalPerDocument) {
  // One channel, kernel 3, w = (1, 10, 100): y[t] = silu(x[t-2] + 10 x[t-1] + 100 x[t]) within a document.
  OwnedTensor x = random_f64(Shape{5, 1}, 1), w(DType::f64, Device::cpu, Shape{1, 3}), y = nan_f64(Shape{5, 1});
  const double wv[] = {1, 10, 100};
  std::copy(wv, wv + 3, w->data<double>());
  for (int64_t i = 0; i < 5; ++i) x->data<double>()[i] = 0.01 * static_cast<double>(i + 1);
  OwnedTensor cu = i32_tensor({0, 2, 5});
  ops::short_conv_forward(process_exec(), *x, *w, *cu, *y);
  const double* xs = x->data<double>();
  const std::vector<double> want = {silu(100 * xs[0]), silu(10 * xs[0] + 100 * xs[1]), silu(100 * xs[2]),
                                    silu(10 * xs[2] + 100 * xs[3]), silu(xs[2] + 10 * xs[3] + 100 * xs[4])};
  for (int64_t i = 0; i < 5; ++i) EXPECT_NEAR(y->data<double>()[i], want[static_cast<size_t>(i)], 1e-15) << i;
}

TEST(ShortConv, GradientsMatchFiniteDifferences) {
  const int64_t n = 13, ch = 5, kernel = 4;
  OwnedTensor x = random_f64(Shape{n, ch}, 2), w = random_f64(Shape{ch, kernel}, 3, 0.5);
  OwnedTensor r = random_f64(Shape{n, ch}, 4), cu = i32_tensor({0, 2, 9, 9, 13});
  OwnedTensor dx = nan_f64(Shape{n, ch}), dw = filled_f64(Shape{ch, kernel}, 0.0);
  ops::short_conv_backward(process_exec(), *x, *w, *cu, *r, *dx, *dw);
  OwnedTensor y = nan_f64(Shape{n, ch});
  const auto eval = [&](std::vector<double>& out) {
    ops::short_conv_forward(process_exec(), *x, *w, *cu, *y);
    out = values_of(*y);
  };
  ScopedCpuThreads one_thread(1);  // tiny ops: a thread team per call only costs
  GradCheckOptions o;
  o.order = 4, o.eps = 1e-4, o.floor = 1e-4, o.tol = 1e-8;
  for (const auto& [name, t, d] : {std::tuple{"x", &x, &dx}, {"w", &w, &dw}}) {
    const GradCheckReport rep = check_gradient(**t, values_of(**d), eval, values_of(*r), o);
    EXPECT_TRUE(rep.ok()) << name << ": " << rep.str();
  }
}

// Two documents interleaved over two slots, in steps of 1 to 3 rows, in f32 and f64.
TEST(ShortConv, StepsEqualTheFullForward) {
  const int64_t ch = 3, kernel = 4;
  OwnedTensor x = random_f64(Shape{11, ch}, 5), w = random_f64(Shape{ch, kernel}, 6), cu = i32_tensor({0, 6, 11});
  OwnedTensor full = nan_f64(Shape{11, ch});
  ops::short_conv_forward(process_exec(), *x, *w, *cu, *full);
  OwnedTensor state = filled_f64(Shape{2, kernel - 1, ch}, 0.0);
  // (row of x, slot) in decode order: each document's rows in order, the two mixed.
  const std::vector<std::vector<std::pair<int, int>>> steps = {
      {{0, 0}, {1, 0}, {6, 1}}, {{2, 0}}, {{7, 1}, {8, 1}, {3, 0}}, {{4, 0}, {9, 1}}, {{5, 0}, {10, 1}}};
  for (const auto& step : steps) {
    const auto rows = static_cast<int64_t>(step.size());
    OwnedTensor xs(DType::f64, Device::cpu, Shape{rows, ch}), ys = nan_f64(Shape{rows, ch});
    std::vector<int32_t> slots;
    for (int64_t i = 0; i < rows; ++i) {
      copy_tensor(x->rows(step[i].first, step[i].first + 1), xs->rows(i, i + 1));
      slots.push_back(step[i].second);
    }
    OwnedTensor slot_t = i32_tensor(slots);
    ops::short_conv_step(process_exec(), *xs, *w, *slot_t, *state, *ys);
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t c = 0; c < ch; ++c)
        EXPECT_NEAR(ys->data<double>()[i * ch + c], full->data<double>()[step[i].first * ch + c], 1e-14);
  }
}

}  // namespace
}  // namespace kiln

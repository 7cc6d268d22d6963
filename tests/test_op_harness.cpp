// The op table's own machinery must be able to fail: the finite-difference checker, the
// comparison (NaN/Inf never pass), and the runner's poison, guards, references,
// gradients and same_bits pairs, each shown on a deliberately broken toy op.
#include "grad_check.h"
#include "op_table/op_checks.h"
#include "op_table/op_compare.h"
#include "ops/elementwise/elementwise.h"
#include "ops/linear/linear.h"

#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

namespace kiln {
namespace {

using namespace kiln::test;
using namespace kiln::op_test;

const GradCheckOptions kExact = op_test::fd_options(1e-8, 1e-4);

// ---- the finite-difference checker ------------------------------------------------------

// out_i = sin(x_i) * x_{i+1} (cyclic): dL/dx_i = R_i cos(x_i) x_{i+1} + R_{i-1} sin(x_{i-1}).
struct ToyProblem {
  OwnedTensor x = random_f64(Shape{9}, 1);
  OwnedTensor r = random_f64(Shape{9}, 2);
  int64_t n() const { return x->numel(); }
  EvalFn eval() const {
    return [this](std::vector<double>& out) {
      const double* p = x->data<double>();
      out.resize(static_cast<size_t>(n()));
      for (int64_t i = 0; i < n(); ++i) out[static_cast<size_t>(i)] = std::sin(p[i]) * p[(i + 1) % n()];
    };
  }
  std::vector<double> grad() const {
    const double *p = x->data<double>(), *w = r->data<double>();
    std::vector<double> g(static_cast<size_t>(n()));
    for (int64_t i = 0; i < n(); ++i) {
      const int64_t next = (i + 1) % n(), prev = (i + n() - 1) % n();
      g[static_cast<size_t>(i)] = w[i] * std::cos(p[i]) * p[next] + w[prev] * std::sin(p[prev]);
    }
    return g;
  }
};

TEST(GradChecker, AcceptsTheTrueGradient) {
  ToyProblem t;
  const GradCheckReport r = check_gradient(*t.x, t.grad(), t.eval(), values_of(*t.r), kExact);
  EXPECT_TRUE(r.ok()) << r.str();
  EXPECT_EQ(r.checked, 9);
  EXPECT_LT(r.max_rel, 1e-9);
}

TEST(GradChecker, ReportsAPerturbedGradient) {
  ToyProblem t;
  for (double factor : {1 + 1e-5, -1.0, 0.0}) {
    std::vector<double> g = t.grad();
    g[4] *= factor;
    const GradCheckReport r = check_gradient(*t.x, g, t.eval(), values_of(*t.r), kExact);
    EXPECT_FALSE(r.ok()) << "factor " << factor;
    EXPECT_EQ(r.failures, 1);
    EXPECT_EQ(r.worst, 4);
  }
  std::vector<double> g = t.grad();
  g[2] = std::nan("");
  EXPECT_FALSE(check_gradient(*t.x, g, t.eval(), values_of(*t.r), kExact).ok());
}

TEST(GradChecker, ReportsAWrongOpGradient) {
  // A real op: linear's dw with one element off by 1e-6 relative is caught, and the
  // subset mode checks exactly the requested number of distinct elements.
  OwnedTensor x = random_f64(Shape{7, 5}, 3), w = random_f64(Shape{3, 5}, 4), r = random_f64(Shape{7, 3}, 5);
  OwnedTensor y(DType::f64, Device::cpu, Shape{7, 3});
  OwnedTensor dw = filled_f64(Shape{3, 5}, 0);
  ops::linear_backward(process_exec(), *x, *w, *r, Tensor(), *dw, Tensor());
  const EvalFn eval = [&](std::vector<double>& out) {
    ops::linear_forward(process_exec(), *x, *w, Tensor(), *y);
    out = values_of(*y);
  };
  std::vector<double> g = values_of(*dw);
  EXPECT_TRUE(check_gradient(*w, g, eval, values_of(*r), kExact).ok());
  g[7] *= 1 + 1e-6;
  const GradCheckReport bad = check_gradient(*w, g, eval, values_of(*r), kExact);
  EXPECT_FALSE(bad.ok()) << bad.str();
  EXPECT_EQ(bad.worst, 7);
  GradCheckOptions subset = kExact;
  subset.max_checks = 6;
  const auto idx = grad_check_indices(15, subset);
  EXPECT_EQ(idx.size(), 6u);
  EXPECT_TRUE(std::adjacent_find(idx.begin(), idx.end()) == idx.end());
  EXPECT_EQ(check_gradient(*w, values_of(*dw), eval, values_of(*r), subset).checked, 6);
}

// ---- the comparison ------------------------------------------------------------------------

TEST(OpCompare, NonFiniteNeverPasses) {
  const std::vector<double> want = {1.0, -2.0, 3.0};
  std::vector<double> got = want;
  EXPECT_TRUE(compare(got, want).within(0));
  got[1] = bf16_to_float(0xFFFFu);  // the poison pattern of a bf16 output
  EXPECT_TRUE(std::isnan(got[1]));
  EXPECT_FALSE(compare(got, want).within(1e30));
  EXPECT_FALSE(compare_exact(got, want).within(1e30));
  got[1] = INFINITY;
  EXPECT_FALSE(compare(got, want).within(1e30));
  got[1] = -2.0;
  std::vector<double> bad_reference = want;
  bad_reference[0] = std::nan("");
  EXPECT_FALSE(compare(got, bad_reference).within(1e30));
  EXPECT_FALSE(compare(std::vector<double>{1.0}, want).within(1e30));  // sizes differ
}

TEST(OpCompare, FloorJudgesSmallElementsAgainstTheScale) {
  // 1e-3 off an element of 1e-3 is 100% relative, but 1e-3 of an output whose scale is 10
  // (floor 0.1) is 1%; per-element floors override the scale.
  const std::vector<double> want = {10.0, 1e-3}, got = {10.0, 2e-3};
  EXPECT_NEAR(compare(got, want).worst, 1e-2, 1e-12);
  EXPECT_EQ(compare(got, want).at, 1);
  EXPECT_NEAR(compare(got, want, 0, {10.0, 1e-3}).worst, 1.0, 1e-12);
  EXPECT_EQ(tolerance_of(DType::bf16).forward, 1e-2);
  EXPECT_LT(tolerance_of(DType::f64).forward, tolerance_of(DType::f32).forward);
}

// ---- the runner on a toy op: y = 2 x, dx = 2 dy --------------------------------------------

OpCase doubling() {
  OpCase c;
  c.op = "toy";
  c.name = "double";
  c.tensors = {in("x", {2, 5}), out("y", {2, 5}), grad_out("dy", "y", {2, 5}), grad_in("dx", "x", {2, 5}),
               out("y_copy", {2, 5}).unchecked()};
  // Through real ops, so any device and precision runs it.
  c.forward = [](const Tensors& t) {
    copy_tensor(t["x"], t["y"]);
    ops::scale_inplace(process_exec(), t["y"], 2.0);
    copy_tensor(t["y"], t["y_copy"]);
  };
  c.backward = [](const Tensors& t) {
    copy_tensor(t["dy"], t["dx"]);
    ops::scale_inplace(process_exec(), t["dx"], 2.0);
  };
  c.reference = [](const Tensors& t) {
    for (int64_t i = 0; i < 10; ++i) t.f64("y")[i] = 2 * t.f64("x")[i];
  };
  c.same_bits = {{"y_copy", "y"}};
  c.fd = kExact;
  return c;
}

TEST(OpRunner, PassesACorrectOp) {
  OpCase c = doubling();
  check_reference(c);
  check_f32_against_f64(c);
  check_gradients(c);
  // The GPU check's machinery (two runs, guards, an offset view) on the CPU's f32.
  check_device(c, DType::f32, Device::cpu);
  c.unaligned = true;
  check_device(c, DType::f32, Device::cpu);
}

TEST(OpRunner, CatchesDifferentBitsBetweenRuns) {
  OpCase c = doubling();
  c.same_bits.clear();  // one failure: y's bytes
  const RunFn full = c.forward;
  c.forward = [full](const Tensors& t) {
    static int calls = 0;
    full(t);
    if (++calls % 2 == 0) ops::scale_inplace(process_exec(), t["y"].rows(0, 1), 1.0 + 1e-7);  // every other run
  };
  EXPECT_NONFATAL_FAILURE(check_device(c, DType::f32, Device::cpu), "y differs between two identical runs");
}

TEST(OpRunner, CatchesAnUnwrittenElement) {
  OpCase c = doubling();
  c.same_bits.clear();  // one failure: the comparison's
  const RunFn full = c.forward;
  c.forward = [full](const Tensors& t) {
    const double keep = t.f64("y")[9];  // the poison
    full(t);
    t.f64("y")[9] = keep;
  };
  EXPECT_NONFATAL_FAILURE(check_reference(c), "not finite");
}

TEST(OpRunner, CatchesAWritePastTheEnd) {
  OpCase c = doubling();
  const RunFn full = c.forward;
  c.forward = [full](const Tensors& t) {
    full(t);
    t.f64("y")[10] = 0;  // the first guard element
  };
  EXPECT_NONFATAL_FAILURE(check_reference(c), "wrote outside y (past its end)");
}

TEST(OpRunner, CatchesAWrongForward) {
  OpCase c = doubling();
  const RunFn full = c.forward;
  c.forward = [full](const Tensors& t) {
    full(t);
    t.f64("y")[3] *= 1 + 1e-9;
    t.f64("y_copy")[3] = t.f64("y")[3];
  };
  EXPECT_NONFATAL_FAILURE(check_reference(c), "toy_double cpu f64 vs cpu f64: y");
}

TEST(OpRunner, CatchesAWrongBackward) {
  OpCase c = doubling();
  c.backward = [](const Tensors& t) {
    for (int64_t i = 0; i < 10; ++i) t.f64("dx")[i] = (i == 6 ? 2.001 : 2.0) * t.f64("dy")[i];
  };
  EXPECT_NONFATAL_FAILURE(check_gradients(c), "dx against finite differences of x");
}

TEST(OpRunner, CatchesDifferentBits) {
  OpCase c = doubling();
  const RunFn full = c.forward;
  c.forward = [full](const Tensors& t) {
    full(t);
    t.f64("y_copy")[0] = std::nextafter(t.f64("y_copy")[0], 1e300);
  };
  EXPECT_NONFATAL_FAILURE(check_reference(c), "y_copy must hold the bits of y");
}

}  // namespace
}  // namespace kiln

// LayerNorm and GeGLU ops on the CPU reference, in the style of test_ops_grad.cpp: the
// forward against a naive fp64 formula written out here, every backward against central
// finite differences in f64 (five-point stencil, objective L = sum(out * R) with a fixed
// random R), the f32 forward against the f64 one, the `=` / `+=` rules and the "[op] ..."
// validation errors. The forward is also checked against an independent numpy oracle of
// torch.nn.functional.layer_norm and transformers' gelu_pytorch_tanh
// (tests/python/check_layer_norm_geglu.py).
//
// Tolerances, relative error |a - n| / max(|a|, |n|, 1e-4):
//   geglu        e = 1e-4, tol 1e-8   (pointwise)
//   layer_norm   e = 1e-5, tol 1e-6   (one row has std ~ 1e-2 on a mean of 3, where eps
//                                      matters and the step must stay small against it)
// f32 forward vs f64 forward on f32-representable inputs: |a32 - a64| <= 1e-5 max(|a64|, rms).
#include "grad_check.h"
#include "io/safetensors.h"
#include "ops/geglu/geglu.h"
#include "ops/layer_norm/layer_norm.h"
#include "test_util.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <string>

namespace kiln {
namespace {

using namespace kiln::test;

constexpr double kF32Tol = 1e-5;

GradCheckOptions tolerance(double tol, double eps) {
  GradCheckOptions o;
  o.order = 4;
  o.tol = tol;
  o.floor = 1e-4;
  o.eps = eps;
  return o;
}

const GradCheckOptions kPointwise = tolerance(1e-8, 1e-4);  // geglu
const GradCheckOptions kNorm = tolerance(1e-6, 1e-5);       // layer_norm

void expect_grad(const std::string& what, const Tensor& x, const std::vector<double>& analytic, const EvalFn& eval,
                 const std::vector<double>& weights, const GradCheckOptions& o) {
  ScopedCpuThreads one_thread(1);  // thousands of tiny forwards; the analytic side ran multi-threaded
  const GradCheckReport r = check_gradient(x, analytic, eval, weights, o);
  EXPECT_TRUE(r.ok()) << what << ": " << r.str();
}

void expect_f32_close(const std::string& what, const std::vector<double>& f32, const std::vector<double>& f64) {
  const double err = max_rel_diff(f32, f64, std::max(rms(f64), 1e-30));
  EXPECT_LT(err, kF32Tol) << what << " f32 vs f64";
}

// Element-wise a - b (for gradients written with +=: accumulated minus the prefill).
std::vector<double> minus(const Tensor& a, const Tensor& b) {
  std::vector<double> va = values_of(a), vb = values_of(b);
  for (size_t i = 0; i < va.size(); ++i) va[i] -= vb[i];
  return va;
}

double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double m = a.size() == b.size() ? 0 : INFINITY;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

// ---- layer_norm ----------------------------------------------------------------------

// Rows of awkward statistics: random rows of scale 1.5, and row 2 a mean of 3 with a
// spread of 1e-2 (mean^2 / var ~ 1e5: E[x^2] - mean^2 would lose five digits; var ~ 1e-4
// against eps 1e-5, so eps matters in the gradient).
struct LayerNormCase {
  static constexpr int64_t kRows = 6, kCols = 7;
  static constexpr double kEps = 1e-5;
  OwnedTensor x = random_f64(Shape{kRows, kCols}, 30, 1.5);
  OwnedTensor w = random_f64(Shape{kCols}, 31, 0.3);
  OwnedTensor b = random_f64(Shape{kCols}, 32, 0.5);
  LayerNormCase() {
    for (int64_t c = 0; c < kCols; ++c) {
      double& v = x->data<double>()[2 * kCols + c];
      v = static_cast<float>(3.0 + v * 1e-2 / 1.5);  // f32-representable, as random_f64's
      w->data<double>()[c] += 1.0;
    }
  }
};

// The textbook formula in f64: mean, biased variance, (x - mean) / sqrt(var + eps) * w + b.
void naive_layer_norm(const Tensor& x, const double* w, const double* b, double eps, std::vector<double>& y,
                      std::vector<double>& mean, std::vector<double>& rstd) {
  const int64_t rows = x.size(0), cols = x.size(1);
  const double* p = x.data<double>();
  y.assign(static_cast<size_t>(rows * cols), 0);
  mean.assign(static_cast<size_t>(rows), 0);
  rstd.assign(static_cast<size_t>(rows), 0);
  for (int64_t r = 0; r < rows; ++r) {
    double mu = 0, var = 0;
    for (int64_t c = 0; c < cols; ++c) mu += p[r * cols + c] / static_cast<double>(cols);
    for (int64_t c = 0; c < cols; ++c) var += (p[r * cols + c] - mu) * (p[r * cols + c] - mu) / static_cast<double>(cols);
    mean[static_cast<size_t>(r)] = mu;
    rstd[static_cast<size_t>(r)] = 1 / std::sqrt(var + eps);
    for (int64_t c = 0; c < cols; ++c)
      y[static_cast<size_t>(r * cols + c)] =
          (p[r * cols + c] - mu) / std::sqrt(var + eps) * (w ? w[c] : 1.0) + (b ? b[c] : 0.0);
  }
}

TEST(OpsGrad, LayerNorm) {
  using C = LayerNormCase;
  for (bool gain : {true, false})
    for (bool bias : {true, false}) {
      SCOPED_TRACE(fmt::format("gain {} bias {}", gain, bias));
      C t;
      const Tensor wt = gain ? *t.w : Tensor(), bt = bias ? *t.b : Tensor();
      OwnedTensor r = random_f64(Shape{C::kRows, C::kCols}, 33);
      OwnedTensor y = nan_f64(Shape{C::kRows, C::kCols}), mean = nan_f64(Shape{C::kRows}),
                  rstd = nan_f64(Shape{C::kRows});
      const EvalFn eval = [&](std::vector<double>& o) {
        ops::layer_norm_forward(process_exec(), *t.x, wt, bt, C::kEps, *y, *mean, *rstd);
        o = values_of(*y);
      };
      std::vector<double> forward;
      eval(forward);  // also the statistics of the unperturbed x, for backward

      // The forward, its mean and rstd against the textbook formula.
      std::vector<double> y_ref, mean_ref, rstd_ref;
      naive_layer_norm(*t.x, gain ? t.w->data<double>() : nullptr, bias ? t.b->data<double>() : nullptr, C::kEps,
                       y_ref, mean_ref, rstd_ref);
      EXPECT_LT(max_rel_diff(forward, y_ref, 1e-3), 1e-12);
      EXPECT_LT(max_rel_diff(values_of(*mean), mean_ref, 1e-3), 1e-14);
      EXPECT_LT(max_rel_diff(values_of(*rstd), rstd_ref, 1e-3), 1e-12);

      // dx written with = (poisoned first); dw and db accumulated into a random prefill.
      OwnedTensor dx = nan_f64(Shape{C::kRows, C::kCols});
      OwnedTensor dw0 = random_f64(Shape{C::kCols}, 34), db0 = random_f64(Shape{C::kCols}, 35);
      OwnedTensor dw = copy_of(*dw0), db = copy_of(*db0);
      ops::layer_norm_backward(process_exec(), *t.x, wt, *mean, *rstd, *r, *dx, gain ? *dw : Tensor(), bias ? *db : Tensor());
      const std::vector<double> weights = values_of(*r);
      expect_grad("layer_norm dx", *t.x, values_of(*dx), eval, weights, kNorm);
      if (gain) expect_grad("layer_norm dw", *t.w, minus(*dw, *dw0), eval, weights, kNorm);
      if (bias) expect_grad("layer_norm db", *t.b, minus(*db, *db0), eval, weights, kNorm);
      if (!gain) {
        EXPECT_EQ(max_abs_diff(values_of(*dw), values_of(*dw0)), 0.0) << "dw written without a gain";
      }
      if (!bias) {
        EXPECT_EQ(max_abs_diff(values_of(*db), values_of(*db0)), 0.0) << "db written without a bias";
      }

      // The bias gradient is the plain column sum of dy; without gain or bias dx is the
      // same function (the bias does not enter dx at all).
      if (bias) {
        std::vector<double> column(C::kCols, 0.0);
        for (int64_t i = 0; i < C::kRows; ++i)
          for (int64_t c = 0; c < C::kCols; ++c) column[static_cast<size_t>(c)] += weights[static_cast<size_t>(i * C::kCols + c)];
        EXPECT_LT(max_abs_diff(minus(*db, *db0), column), 1e-14);
      }

      // accumulate_dx = true adds the same gradient to what dx holds.
      OwnedTensor dx_acc = random_f64(Shape{C::kRows, C::kCols}, 36), dx_pre = copy_of(*dx_acc);
      ops::layer_norm_backward(process_exec(), *t.x, wt, *mean, *rstd, *r, *dx_acc, Tensor(), Tensor(), true);
      EXPECT_LT(max_abs_diff(minus(*dx_acc, *dx_pre), values_of(*dx)), 1e-12);

      // dx_copy receives dx's final values; a copy of the wrong shape is refused by name.
      OwnedTensor copy = nan_f64(Shape{C::kRows, C::kCols});
      ops::layer_norm_backward(process_exec(), *t.x, wt, *mean, *rstd, *r, *dx_acc, Tensor(), Tensor(), true, *copy);
      EXPECT_EQ(max_abs_diff(values_of(*copy), values_of(*dx_acc)), 0.0);
      OwnedTensor short_copy = nan_f64(Shape{C::kRows - 1, C::kCols});
      const std::string error = error_of(
          [&] { ops::layer_norm_backward(process_exec(), *t.x, wt, *mean, *rstd, *r, *dx_acc, Tensor(), Tensor(), true, *short_copy); });
      EXPECT_NE(error.find("[layer_norm_backward] dx_copy"), std::string::npos) << error;

      // Recompute: the forward run again gives the same bits.
      std::vector<double> again;
      eval(again);
      EXPECT_EQ(max_abs_diff(again, forward), 0.0);

      // f32 forward. Row 2 (mean / std ~ 300) is judged apart: there fp32 cannot do better
      // than ~300 x 2^-24 = 2e-5 (the rounding of values near 3, relative to deviations of
      // 1e-2), so it gets 1e-4; the well-conditioned rows get the usual 1e-5.
      OwnedTensor x32 = to_f32(*t.x), w32 = to_f32(*t.w), b32 = to_f32(*t.b);
      OwnedTensor y32(DType::f32, Device::cpu, Shape{C::kRows, C::kCols});
      OwnedTensor mean32(DType::f32, Device::cpu, Shape{C::kRows}), rstd32(DType::f32, Device::cpu, Shape{C::kRows});
      ops::layer_norm_forward(process_exec(), *x32, gain ? *w32 : Tensor(), bias ? *b32 : Tensor(), C::kEps, *y32, *mean32, *rstd32);
      const std::vector<double> y32v = values_of(*y32);
      auto rows_of = [](const std::vector<double>& v, int64_t begin, int64_t end) {
        return std::vector<double>(v.begin() + begin * C::kCols, v.begin() + end * C::kCols);
      };
      std::vector<double> well_32 = rows_of(y32v, 0, 2), well_64 = rows_of(forward, 0, 2);
      for (double v : rows_of(y32v, 3, C::kRows)) well_32.push_back(v);
      for (double v : rows_of(forward, 3, C::kRows)) well_64.push_back(v);
      expect_f32_close("layer_norm", well_32, well_64);
      const std::vector<double> row2_64 = rows_of(forward, 2, 3);
      EXPECT_LT(max_rel_diff(rows_of(y32v, 2, 3), row2_64, rms(row2_64)), 1e-4) << "layer_norm f32 vs f64, row 2";
      expect_f32_close("layer_norm rstd", values_of(*rstd32), values_of(*rstd));
    }
}

// The CPU form of the fused residual add: sum = a + branch, then the norm of sum.
TEST(OpsGrad, AddLayerNormIsAddThenNorm) {
  using C = LayerNormCase;
  C t;
  OwnedTensor a = random_f64(Shape{C::kRows, C::kCols}, 40), branch = random_f64(Shape{C::kRows, C::kCols}, 41);
  OwnedTensor sum = nan_f64(a->shape()), y = nan_f64(a->shape()), mean = nan_f64(Shape{C::kRows}),
              rstd = nan_f64(Shape{C::kRows});
  ops::add_layer_norm_forward(process_exec(), *a, *branch, *t.w, *t.b, C::kEps, *sum, *y, *mean, *rstd);
  std::vector<double> expected_sum = values_of(*a);
  for (size_t i = 0; i < expected_sum.size(); ++i) expected_sum[i] += values_of(*branch)[i];
  EXPECT_EQ(max_abs_diff(values_of(*sum), expected_sum), 0.0);
  OwnedTensor y2 = nan_f64(a->shape()), mean2 = nan_f64(Shape{C::kRows}), rstd2 = nan_f64(Shape{C::kRows});
  ops::layer_norm_forward(process_exec(), *sum, *t.w, *t.b, C::kEps, *y2, *mean2, *rstd2);
  EXPECT_EQ(max_abs_diff(values_of(*y), values_of(*y2)), 0.0);
  EXPECT_EQ(max_abs_diff(values_of(*rstd), values_of(*rstd2)), 0.0);
  EXPECT_EQ(max_abs_diff(values_of(*mean), values_of(*mean2)), 0.0);
}

TEST(OpsGrad, LayerNormRejectsBadInput) {
  using C = LayerNormCase;
  C t;
  OwnedTensor y = nan_f64(t.x->shape()), mean = nan_f64(Shape{C::kRows}), rstd = nan_f64(Shape{C::kRows});
  OwnedTensor short_w = nan_f64(Shape{C::kCols - 1}), short_rows = nan_f64(Shape{C::kRows - 1});
  OwnedTensor y32(DType::f32, Device::cpu, t.x->shape());
  auto starts_with = [](const std::string& s, const std::string& prefix) { return s.rfind(prefix, 0) == 0; };
  std::string e = error_of([&] { ops::layer_norm_forward(process_exec(), *t.x, *short_w, *t.b, C::kEps, *y, *mean, *rstd); });
  EXPECT_TRUE(starts_with(e, "[layer_norm] w must be [7]")) << e;
  e = error_of([&] { ops::layer_norm_forward(process_exec(), *t.x, *t.w, *short_w, C::kEps, *y, *mean, *rstd); });
  EXPECT_TRUE(starts_with(e, "[layer_norm] b must be [7]")) << e;
  e = error_of([&] { ops::layer_norm_forward(process_exec(), *t.x, *t.w, *t.b, C::kEps, *y, *short_rows, *rstd); });
  EXPECT_TRUE(starts_with(e, "[layer_norm] mean must be [6]")) << e;
  e = error_of([&] { ops::layer_norm_forward(process_exec(), *t.x, *t.w, *t.b, 0.0, *y, *mean, *rstd); });
  EXPECT_TRUE(starts_with(e, "[layer_norm] eps must be positive")) << e;
  e = error_of([&] { ops::layer_norm_forward(process_exec(), *t.x, *t.w, *t.b, C::kEps, *y32, *mean, *rstd); });
  EXPECT_TRUE(starts_with(e, "[layer_norm] y must be f64")) << e;
  OwnedTensor dx = nan_f64(t.x->shape()), dw = nan_f64(Shape{C::kCols});
  e = error_of([&] { ops::layer_norm_backward(process_exec(), *t.x, Tensor(), *mean, *rstd, *y, *dx, *dw, Tensor()); });
  EXPECT_TRUE(starts_with(e, "[layer_norm_backward] dw given for a norm without gain")) << e;
  e = error_of([&] { ops::layer_norm_backward(process_exec(), *t.x, *t.w, *mean, *rstd, *y, *dx, Tensor(), *short_w); });
  EXPECT_TRUE(starts_with(e, "[layer_norm_backward] db must be [7]")) << e;
}

// ---- geglu ---------------------------------------------------------------------------

// gelu_tanh written out from its definition, independently of ops/geglu/gelu_tanh.h.
double naive_gelu_tanh(double x) {
  const double pi = std::acos(-1.0);
  return 0.5 * x * (1 + std::tanh(std::sqrt(2 / pi) * (x + 0.044715 * x * x * x)));
}

TEST(OpsGrad, Geglu) {
  const int64_t n = 5, f = 7;
  OwnedTensor gu = random_f64(Shape{n, 2 * f}, 70, 2.0), r = random_f64(Shape{n, f}, 71);
  // Gates far out on both sides, where tanh saturates.
  gu->data<double>()[0] = 6.5;
  gu->data<double>()[1] = -7.25;
  OwnedTensor out = nan_f64(Shape{n, f});
  const EvalFn eval = [&](std::vector<double>& o) {
    ops::geglu_forward(process_exec(), *gu, *out);
    o = values_of(*out);
  };
  std::vector<double> ref;
  eval(ref);
  const double* p = gu->data<double>();
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < f; ++j) {
      const double g = p[i * 2 * f + j], u = p[i * 2 * f + f + j];
      EXPECT_NEAR(ref[static_cast<size_t>(i * f + j)], naive_gelu_tanh(g) * u, 1e-14 * (1 + std::abs(g * u)));
      // The tanh form stays within 1e-3 of the exact GELU x * Phi(x) (so the constants
      // are the right ones, not merely the same ones twice).
      EXPECT_NEAR(naive_gelu_tanh(g), 0.5 * g * (1 + std::erf(g / std::sqrt(2.0))), 1e-3);
    }
  OwnedTensor dgu = nan_f64(gu->shape());
  ops::geglu_backward(process_exec(), *gu, *r, *dgu);
  expect_grad("geglu dgate_up", *gu, values_of(*dgu), eval, values_of(*r), kPointwise);
  // The backward that rebuilds the output over its input gradient (the MLP's recompute):
  // the same gradient, and the forward's output to the bit.
  OwnedTensor dgu2 = nan_f64(gu->shape()), r_then_out = copy_of(*r);
  ops::geglu_backward(process_exec(), *gu, *r_then_out, *dgu2, *r_then_out);
  EXPECT_EQ(max_abs_diff(values_of(*dgu2), values_of(*dgu)), 0.0);
  EXPECT_EQ(max_abs_diff(values_of(*r_then_out), ref), 0.0);
  OwnedTensor gu32 = to_f32(*gu), o32(DType::f32, Device::cpu, Shape{n, f});
  ops::geglu_forward(process_exec(), *gu32, *o32);
  expect_f32_close("geglu", values_of(*o32), ref);
  // Validation names the op and the operand.
  OwnedTensor odd = nan_f64(Shape{n, 2 * f + 1}), wrong = nan_f64(Shape{n, f + 1});
  std::string e = error_of([&] { ops::geglu_forward(process_exec(), *odd, *out); });
  EXPECT_EQ(e.rfind("[geglu] gate_up must have an even number of columns", 0), 0u) << e;
  e = error_of([&] { ops::geglu_backward(process_exec(), *gu, *wrong, *dgu); });
  EXPECT_EQ(e.rfind("[geglu_backward] dout must be [5, 7]", 0), 0u) << e;
}

// ---- against numpy --------------------------------------------------------------------

// kiln's CPU forwards (f32 and f64) of both ops on random inputs, written to a safetensors
// file for tests/python/check_layer_norm_geglu.py, which recomputes them with numpy as
// torch.nn.functional.layer_norm and gelu_pytorch_tanh define them (and with torch itself
// where torch is installed).
TEST(OpsOracle, LayerNormAndGegluMatchNumpy) {
  const int64_t rows = 9, cols = 33, f = 29;
  const double eps = 1e-5;
  io::SafetensorsWriter file;
  OwnedTensor x = random_f64(Shape{rows, cols}, 90, 2.0), w = random_f64(Shape{cols}, 91), b = random_f64(Shape{cols}, 92);
  for (int64_t c = 0; c < cols; ++c) x->data<double>()[c] += 5.0;  // a row with a large mean
  OwnedTensor gu = random_f64(Shape{rows, 2 * f}, 93, 3.0);
  file.add("layer_norm.x", *x);
  file.add("layer_norm.weight", *w);
  file.add("layer_norm.bias", *b);
  file.add("geglu.gate_up", *gu);
  for (DType dtype : {DType::f64, DType::f32}) {
    const std::string tag = dtype == DType::f64 ? "f64" : "f32";
    OwnedTensor xt = dtype == DType::f64 ? copy_of(*x) : to_f32(*x), wt = dtype == DType::f64 ? copy_of(*w) : to_f32(*w);
    OwnedTensor bt = dtype == DType::f64 ? copy_of(*b) : to_f32(*b), gut = dtype == DType::f64 ? copy_of(*gu) : to_f32(*gu);
    OwnedTensor y(dtype, Device::cpu, Shape{rows, cols}), mean(dtype, Device::cpu, Shape{rows}),
        rstd(dtype, Device::cpu, Shape{rows}), y_nobias(dtype, Device::cpu, Shape{rows, cols});
    ops::layer_norm_forward(process_exec(), *xt, *wt, *bt, eps, *y, *mean, *rstd);
    ops::layer_norm_forward(process_exec(), *xt, *wt, Tensor(), eps, *y_nobias, *mean, *rstd);
    OwnedTensor act(dtype, Device::cpu, Shape{rows, f});
    ops::geglu_forward(process_exec(), *gut, *act);
    file.add("layer_norm.y." + tag, *y);
    file.add("layer_norm_nobias.y." + tag, *y_nobias);
    file.add("geglu.out." + tag, *act);
  }
  file.set_metadata("eps", fmt::format("{}", eps));
  const std::string dir = temp_dir("kiln-numpy-oracle");
  file.write(dir + "/ops.safetensors");
  std::string output;
  const int code = run_command(kiln_python() + " " + KILN_SOURCE_DIR "/tests/python/check_layer_norm_geglu.py " +
                                   dir + "/ops.safetensors",
                               &output);
  EXPECT_EQ(code, 0) << output;
  EXPECT_NE(output.find("layer_norm and geglu match numpy"), std::string::npos) << output;
  // KILN_KEEP_ORACLE_FILE=PATH keeps the file (to check it against torch where torch is).
  if (const char* keep = std::getenv("KILN_KEEP_ORACLE_FILE"))
    std::filesystem::copy_file(dir + "/ops.safetensors", keep, std::filesystem::copy_options::overwrite_existing);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kiln

// Finite-difference gradient checking for the f64 CPU reference (header-only).
//
// An objective is L = sum_j out_j * weight_j over the outputs an `eval` callback writes.
// The numeric derivative by element i of x is sum_j (out+_j - out-_j) * weight_j / (2 eps):
// differencing outputs before weighting keeps the outputs that do not depend on x_i
// bitwise equal (zero contribution), so round-off stays near ulp(out) / eps instead of
// ulp(L) / eps. A scalar objective is the special case of one output with weight 1.
#pragma once

#include "core/rng.h"
#include "core/tensor.h"
#include "ops/parallel.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

namespace kiln::test {

struct GradCheckOptions {
  double eps = 1e-6;          // central-difference step
  int order = 2;              // 2: (f(x+e) - f(x-e)) / 2e;  4: the five-point stencil
                              //    (8 [f(x+e) - f(x-e)] - [f(x+2e) - f(x-2e)]) / 12e
  double tol = 1e-6;          // largest accepted relative error
  double floor = 1e-3;        // relative error = |a - n| / max(|a|, |n|, floor)
  int64_t max_checks = 0;     // 0 = every element; else a random subset of this many
  uint64_t seed = 12345;      // chooses the subset
};

// What the whole-model fp64 checks use: the five-point stencil with step 1e-4, relative
// errors above a 1e-4 floor within 1e-6.
inline GradCheckOptions model_grad_check_options() {
  GradCheckOptions o;
  o.order = 4;
  o.eps = 1e-4;
  o.floor = 1e-4;
  o.tol = 1e-6;
  return o;
}

struct GradCheckReport {
  int64_t checked = 0;
  int64_t failures = 0;       // elements whose relative error exceeds tol (or is not finite)
  double max_rel = 0;
  int64_t worst = -1;         // flat index of the worst element
  double worst_analytic = 0, worst_numeric = 0;

  bool ok() const { return checked > 0 && failures == 0; }
  std::string str() const {
    return fmt::format("{} checked, {} failed, max rel err {:.3e} at [{}] (analytic {:.12e}, numeric {:.12e})",
                       checked, failures, max_rel, worst, worst_analytic, worst_numeric);
  }
};

using EvalFn = std::function<void(std::vector<double>& out)>;

// Indices of the elements to check: all, or `max_checks` distinct ones chosen at random.
inline std::vector<int64_t> grad_check_indices(int64_t n, const GradCheckOptions& o) {
  std::vector<int64_t> idx(static_cast<size_t>(n));
  std::iota(idx.begin(), idx.end(), int64_t{0});
  if (o.max_checks <= 0 || o.max_checks >= n) return idx;
  Rng rng(o.seed);
  for (int64_t i = 0; i < o.max_checks; ++i) {  // partial Fisher-Yates
    const int64_t j = i + static_cast<int64_t>(rng.below(static_cast<uint64_t>(n - i)));
    std::swap(idx[static_cast<size_t>(i)], idx[static_cast<size_t>(j)]);
  }
  idx.resize(static_cast<size_t>(o.max_checks));
  std::sort(idx.begin(), idx.end());
  return idx;
}

// Compares `analytic` (dL/dx, numel(x) values) with central differences of L, perturbing
// the f64 tensor x in place (each element is restored exactly afterwards).
inline GradCheckReport check_gradient(const Tensor& x, const std::vector<double>& analytic, const EvalFn& eval,
                                      const std::vector<double>& weights, const GradCheckOptions& o = {}) {
  KILN_CHECK(x.dtype() == DType::f64 && x.device() == Device::cpu, "grad_check", "x must be f64 on the cpu");
  KILN_CHECK(static_cast<int64_t>(analytic.size()) == x.numel(), "grad_check", "analytic has {} values, x {}",
             analytic.size(), x.numel());
  double* data = x.data<double>();
  GradCheckReport r;
  KILN_CHECK(o.order == 2 || o.order == 4, "grad_check", "order must be 2 or 4, got {}", o.order);
  std::vector<double> plus, minus;
  // sum_j (out(x_i + s) - out(x_i - s))_j * weight_j
  auto central = [&](int64_t i, double step) {
    const double saved = data[i];
    data[i] = saved + step;
    eval(plus);
    data[i] = saved - step;
    eval(minus);
    data[i] = saved;
    KILN_CHECK(plus.size() == weights.size() && minus.size() == weights.size(), "grad_check",
               "eval wrote {} outputs, weights has {}", plus.size(), weights.size());
    double sum = 0;
    for (size_t j = 0; j < weights.size(); ++j) {
      const double diff = plus[j] - minus[j];
      if (diff != 0) sum += diff * weights[j];
    }
    return sum;
  };
  for (int64_t i : grad_check_indices(x.numel(), o)) {
    const double numeric = o.order == 2 ? central(i, o.eps) / (2 * o.eps)
                                        : (8 * central(i, o.eps) - central(i, 2 * o.eps)) / (12 * o.eps);
    const double a = analytic[static_cast<size_t>(i)];
    const double rel = std::abs(a - numeric) / std::max({std::abs(a), std::abs(numeric), o.floor});
    const bool bad = !(rel <= o.tol) || !std::isfinite(a);
    ++r.checked;
    if (bad) ++r.failures;
    if (!(rel <= r.max_rel) || r.worst < 0) {
      r.max_rel = std::isfinite(rel) ? rel : INFINITY;
      r.worst = i;
      r.worst_analytic = a;
      r.worst_numeric = numeric;
    }
  }
  eval(plus);  // leave whatever eval computes (saved forward state) as for the unperturbed x
  return r;
}

// Scalar objective L = f().
inline GradCheckReport check_gradient_scalar(const Tensor& x, const std::vector<double>& analytic,
                                             const std::function<double()>& f, const GradCheckOptions& o = {}) {
  return check_gradient(x, analytic, [&](std::vector<double>& out) { out.assign(1, f()); }, {1.0}, o);
}

// ---- small host-tensor helpers -------------------------------------------------------

// f64 values drawn from N(0, scale) and rounded to f32, so the same inputs feed the f32
// and f64 paths exactly.
inline OwnedTensor random_f64(Shape shape, uint64_t seed, double scale = 1.0) {
  OwnedTensor t(DType::f64, Device::cpu, shape);
  Rng rng(seed);
  double* p = t->data<double>();
  for (int64_t i = 0; i < t->numel(); ++i) p[i] = static_cast<double>(static_cast<float>(rng.normal() * scale));
  return t;
}

inline OwnedTensor filled_f64(Shape shape, double value) {
  OwnedTensor t(DType::f64, Device::cpu, shape);
  std::fill(t->data<double>(), t->data<double>() + t->numel(), value);
  return t;
}

inline OwnedTensor nan_f64(Shape shape) { return filled_f64(shape, std::nan("")); }

inline OwnedTensor i32_tensor(const std::vector<int32_t>& values) {
  OwnedTensor t(DType::i32, Device::cpu, Shape{static_cast<int64_t>(values.size())});
  std::copy(values.begin(), values.end(), t->data<int32_t>());
  return t;
}

inline std::vector<double> values_of(const Tensor& t) {
  if (t.dtype() == DType::f32) {
    const float* p = t.data<float>();
    return std::vector<double>(p, p + t.numel());
  }
  const double* p = t.data<double>();
  return std::vector<double>(p, p + t.numel());
}

inline OwnedTensor copy_of(const Tensor& t) {
  OwnedTensor c(t.dtype(), Device::cpu, t.shape());
  copy_tensor(t, *c);
  return c;
}

// f64 -> f32 copy (for the f32-versus-f64 forward comparison).
inline OwnedTensor to_f32(const Tensor& t) {
  OwnedTensor c(DType::f32, Device::cpu, t.shape());
  const double* s = t.data<double>();
  float* d = c->data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) d[i] = static_cast<float>(s[i]);
  return c;
}

// Largest |a - b| / max(|b|, floor) over the elements; NaN anywhere gives infinity.
inline double max_rel_diff(const std::vector<double>& a, const std::vector<double>& b, double floor) {
  if (a.size() != b.size()) return INFINITY;
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double rel = std::abs(a[i] - b[i]) / std::max(std::abs(b[i]), floor);
    if (!(rel <= worst)) worst = std::isfinite(rel) ? rel : INFINITY;
  }
  return worst;
}

// Largest |a - b| over the largest |b|: a difference relative to the vector's scale, for
// values (losses, norms, weights) whose small elements mean nothing alone. Sizes that
// differ, or NaN anywhere, give infinity.
inline double max_diff_over_max(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return INFINITY;
  double diff = 0, scale = 1e-300;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = std::abs(a[i] - b[i]);
    if (!(d <= diff)) diff = std::isfinite(d) ? d : INFINITY;
    scale = std::max(scale, std::abs(b[i]));
  }
  return diff / scale;
}

// Root mean square of the values (a scale for relative comparisons near zero).
inline double rms(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x * x;
  return v.empty() ? 0 : std::sqrt(s / static_cast<double>(v.size()));
}

// What a whole-model gradient check measured: elements checked, and the worst relative
// error with its parameter's name (the tests print it, so a bar's margin is visible).
struct ParameterGradientReport {
  int64_t checked = 0;
  double worst = 0;
  std::string worst_name;
  std::string str() const {
    return fmt::format("{} parameters checked, max rel err {:.2e} ({})", checked, worst, worst_name);
  }
};

// Every parameter of model `m` (its analytic gradients in `grads`, in parameter order)
// against central differences of `objective`; together they must cover every value.
template <typename Model, typename Objective>
ParameterGradientReport expect_parameter_gradients_match(const Model& m, const std::vector<std::vector<double>>& grads,
                                                         const Objective& objective) {
  const GradCheckOptions o = model_grad_check_options();
  ParameterGradientReport report;
  for (size_t i = 0; i < m.parameters().size(); ++i) {
    const auto& p = m.parameters()[i];
    const GradCheckReport r = check_gradient_scalar(p->value(), grads[i], objective, o);
    EXPECT_TRUE(r.ok()) << p->name() << ": " << r.str();
    report.checked += r.checked;
    if (r.max_rel > report.worst) report.worst = r.max_rel, report.worst_name = p->name();
  }
  EXPECT_EQ(report.checked, m.parameter_count());
  return report;
}

// The same with the gradients the parameters hold now (after the model's backward).
template <typename Model, typename Objective>
ParameterGradientReport expect_parameter_gradients_match(const Model& m, const Objective& objective) {
  std::vector<std::vector<double>> grads;
  for (const auto& p : m.parameters()) grads.push_back(values_of(p->grad()));
  return expect_parameter_gradients_match(m, grads, objective);
}

// Runs a scope on a given CPU thread count, restoring the previous count on exit. Finite
// differences run thousands of tiny forwards: one thread is fast and immune to the
// OpenMP barrier stalls that two threads suffer on a loaded two-core machine.
class ScopedCpuThreads {
 public:
  explicit ScopedCpuThreads(int threads) : saved_(cpu_threads()) { set_cpu_threads(threads); }
  ~ScopedCpuThreads() { set_cpu_threads(saved_); }
  ScopedCpuThreads(const ScopedCpuThreads&) = delete;
  ScopedCpuThreads& operator=(const ScopedCpuThreads&) = delete;

 private:
  int saved_;
};

}  // namespace kiln::test

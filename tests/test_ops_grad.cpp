// Gradient checks of every op's backward by central finite differences in f64, f32-vs-f64
// forward agreement, and naive references for attention and the chunked LM-head loss.
//
// Each op is checked on an objective L = sum(out * R) with a fixed random R (the LM head
// loss is already a scalar). Derivatives use the five-point central stencil
// (8 [L(x+e) - L(x-e)] - [L(x+2e) - L(x-2e)]) / 12e: plain central differences with
// e = 1e-6 leave ~5e-10 of round-off noise, i.e. up to 1e-5 relative on small gradient
// elements; this stencil's noise is ~1e-11, so the tolerances below can be tight.
// Relative error = |a - n| / max(|a|, |n|, 1e-4) (the floor covers near-zero elements):
//   linear, embedding, swiglu, qkv split/merge, rope   e = 1e-4, tol 1e-8  (seen <= 2e-9)
//   rms_norm                                           e = 1e-5, tol 1e-6  (seen ~ 4e-9; one
//                                                      row has |x| ~ 3e-3 so e must be small)
//   attention                                          e = 1e-4, tol 1e-6  (seen <= 8e-8)
//   lm_head_loss (scalar objective)                    e = 1e-4, tol 1e-6  (seen <= 2e-8)
// f32 forward vs f64 forward on f32-representable inputs: |a32 - a64| <= 1e-5 max(|a64|, rms).
#include "grad_check.h"
#include "test_util.h"
#include "ops/attention/attention.h"
#include "ops/attention/qkv_prepare.h"
#include "ops/cross_entropy/lm_head_loss.h"
#include "ops/embedding/embedding.h"
#include "ops/linear/linear.h"
#include "ops/rms_norm/rms_norm.h"
#include "ops/rope/rope.h"
#include "ops/split/qkv_split.h"
#include "ops/swiglu/swiglu.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

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

const GradCheckOptions kExact = tolerance(1e-8, 1e-4);      // (multi)linear and pointwise ops
const GradCheckOptions kNorm = tolerance(1e-6, 1e-5);       // rms_norm
const GradCheckOptions kAttention = tolerance(1e-6, 1e-4);  // attention
const GradCheckOptions kScalar = tolerance(1e-6, 1e-4);     // the LM-head loss (a scalar objective)

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

bool all_zero(const std::vector<double>& v) {
  for (double x : v)
    if (x != 0) return false;
  return true;
}

// ---- the checker itself must be able to fail -------------------------------------------

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
  ops::linear_backward(*x, *w, *r, Tensor(), *dw, Tensor());
  const EvalFn eval = [&](std::vector<double>& out) {
    ops::linear_forward(*x, *w, Tensor(), *y);
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

// ---- linear --------------------------------------------------------------------------

TEST(OpsGrad, Linear) {
  const int64_t n = 7, in = 5, out = 3;
  for (bool bias : {false, true}) {
    SCOPED_TRACE(bias ? "bias" : "no bias");
    OwnedTensor x = random_f64(Shape{n, in}, 10), w = random_f64(Shape{out, in}, 11), b = random_f64(Shape{out}, 12);
    OwnedTensor r = random_f64(Shape{n, out}, 13);
    const Tensor bt = bias ? *b : Tensor();
    OwnedTensor y(DType::f64, Device::cpu, Shape{n, out});
    const EvalFn eval = [&](std::vector<double>& o) {
      ops::linear_forward(*x, *w, bt, *y);
      o = values_of(*y);
    };
    // dx written with = (poisoned first), dw and db accumulated into a random prefill.
    OwnedTensor dx = nan_f64(Shape{n, in});
    OwnedTensor dw0 = random_f64(Shape{out, in}, 14), db0 = random_f64(Shape{out}, 15);
    OwnedTensor dw = copy_of(*dw0), db = copy_of(*db0);
    ops::linear_backward(*x, *w, *r, *dx, *dw, bias ? *db : Tensor());
    const std::vector<double> weights = values_of(*r);
    expect_grad("linear dx", *x, values_of(*dx), eval, weights, kExact);
    expect_grad("linear dw", *w, minus(*dw, *dw0), eval, weights, kExact);
    if (bias) expect_grad("linear db", *b, minus(*db, *db0), eval, weights, kExact);
    if (!bias) {
      EXPECT_EQ(max_abs_diff(values_of(*db), values_of(*db0)), 0.0);
    }

    // accumulate_dx: dx += the same gradient.
    OwnedTensor dx_acc = random_f64(Shape{n, in}, 16), dx_pre = copy_of(*dx_acc);
    ops::linear_backward(*x, *w, *r, *dx_acc, Tensor(), Tensor(), true);
    EXPECT_LT(max_abs_diff(minus(*dx_acc, *dx_pre), values_of(*dx)), 1e-13);

    // f32 forward.
    OwnedTensor x32 = to_f32(*x), w32 = to_f32(*w), b32 = to_f32(*b), y32(DType::f32, Device::cpu, Shape{n, out});
    ops::linear_forward(*x32, *w32, bias ? *b32 : Tensor(), *y32);
    ops::linear_forward(*x, *w, bt, *y);
    expect_f32_close("linear", values_of(*y32), values_of(*y));
  }
}

// ---- embedding -----------------------------------------------------------------------

TEST(OpsGrad, EmbeddingWithRepeatedIds) {
  const int64_t vocab = 6, dim = 5;
  const std::vector<int32_t> ids = {2, 0, 2, 5, 2, 1, 0, 2};  // 3 and 4 unused, 2 four times
  const int64_t n = static_cast<int64_t>(ids.size());
  OwnedTensor tokens = i32_tensor(ids), table = random_f64(Shape{vocab, dim}, 20), r = random_f64(Shape{n, dim}, 21);
  OwnedTensor out = nan_f64(Shape{n, dim});
  const EvalFn eval = [&](std::vector<double>& o) {
    ops::embedding_forward(*tokens, *table, *out);
    o = values_of(*out);
  };
  OwnedTensor d0 = random_f64(Shape{vocab, dim}, 22), d = copy_of(*d0);
  ops::embedding_backward(*tokens, *r, *d);
  const std::vector<double> g = minus(*d, *d0);
  expect_grad("embedding dtable", *table, g, eval, values_of(*r), kExact);
  for (int64_t c = 0; c < dim; ++c) {  // unused rows untouched, exactly
    EXPECT_EQ(g[static_cast<size_t>(3 * dim + c)], 0.0);
    EXPECT_EQ(g[static_cast<size_t>(4 * dim + c)], 0.0);
  }
  OwnedTensor t32 = to_f32(*table), o32(DType::f32, Device::cpu, Shape{n, dim});
  ops::embedding_forward(*tokens, *t32, *o32);
  ops::embedding_forward(*tokens, *table, *out);
  EXPECT_EQ(max_abs_diff(values_of(*o32), values_of(*out)), 0.0);  // a copy: exact
}

// ---- rms_norm ------------------------------------------------------------------------

TEST(OpsGrad, RmsNorm) {
  const int64_t rows = 6, cols = 7;
  const double eps = 1e-5;
  for (bool gain : {true, false}) {
    SCOPED_TRACE(gain ? "gain" : "no gain");
    OwnedTensor x = random_f64(Shape{rows, cols}, 30, 1.5);
    // One row with mean(x^2) ~ eps, where eps matters in the gradient.
    for (int64_t c = 0; c < cols; ++c) x->data<double>()[2 * cols + c] *= 2e-3;
    OwnedTensor w = random_f64(Shape{cols}, 31, 0.3);
    for (int64_t c = 0; c < cols; ++c) w->data<double>()[c] += 1.0;
    const Tensor wt = gain ? *w : Tensor();
    OwnedTensor r = random_f64(Shape{rows, cols}, 32);
    OwnedTensor y(DType::f64, Device::cpu, Shape{rows, cols}), rstd(DType::f64, Device::cpu, Shape{rows});
    const EvalFn eval = [&](std::vector<double>& o) {
      ops::rms_norm_forward(*x, wt, eps, *y, *rstd);
      o = values_of(*y);
    };
    std::vector<double> tmp;
    eval(tmp);  // rstd of the unperturbed x, for backward
    OwnedTensor dx = nan_f64(Shape{rows, cols});
    OwnedTensor dw0 = random_f64(Shape{cols}, 33), dw = copy_of(*dw0);
    ops::rms_norm_backward(*x, wt, *rstd, *r, *dx, gain ? *dw : Tensor(), false);
    const std::vector<double> weights = values_of(*r);
    expect_grad("rms_norm dx", *x, values_of(*dx), eval, weights, kNorm);
    if (gain) expect_grad("rms_norm dw", *w, minus(*dw, *dw0), eval, weights, kNorm);

    // accumulate_dx = true adds the same gradient to what dx holds.
    OwnedTensor dx_acc = random_f64(Shape{rows, cols}, 34), dx_pre = copy_of(*dx_acc);
    ops::rms_norm_backward(*x, wt, *rstd, *r, *dx_acc, Tensor(), true);
    EXPECT_LT(max_abs_diff(minus(*dx_acc, *dx_pre), values_of(*dx)), 1e-12);

    // dx_copy receives dx's final values (the residual gradient's copy the branches read);
    // a copy of the wrong shape is refused by name.
    OwnedTensor dx_again = random_f64(Shape{rows, cols}, 34), copy = nan_f64(Shape{rows, cols});
    ops::rms_norm_backward(*x, wt, *rstd, *r, *dx_again, Tensor(), true, *copy);
    EXPECT_EQ(max_abs_diff(values_of(*copy), values_of(*dx_again)), 0.0);
    OwnedTensor short_copy = nan_f64(Shape{rows - 1, cols});
    const std::string error = test::error_of(
        [&] { ops::rms_norm_backward(*x, wt, *rstd, *r, *dx_again, Tensor(), true, *short_copy); });
    EXPECT_NE(error.find("dx_copy"), std::string::npos) << error;

    // rstd is 1 / sqrt(mean(x^2) + eps).
    for (int64_t i = 0; i < rows; ++i) {
      double ss = 0;
      for (int64_t c = 0; c < cols; ++c) ss += x->data<double>()[i * cols + c] * x->data<double>()[i * cols + c];
      EXPECT_NEAR(rstd->data<double>()[i], 1 / std::sqrt(ss / cols + eps), 1e-12 * rstd->data<double>()[i]);
    }

    OwnedTensor x32 = to_f32(*x), w32 = to_f32(*w), y32(DType::f32, Device::cpu, Shape{rows, cols}),
                r32(DType::f32, Device::cpu, Shape{rows});
    ops::rms_norm_forward(*x32, gain ? *w32 : Tensor(), eps, *y32, *r32);
    expect_f32_close("rms_norm", values_of(*y32), values_of(*y));
  }
}

// ---- rope ----------------------------------------------------------------------------

struct RopeTables {
  OwnedTensor cos, sin;
  RopeTables(double theta, int64_t head_dim, int64_t max_pos, DType dtype)
      : cos(dtype, Device::cpu, Shape{max_pos, head_dim / 2}), sin(dtype, Device::cpu, Shape{max_pos, head_dim / 2}) {
    ops::rope_fill_tables(ops::rope_inverse_frequencies(theta, head_dim), *cos, *sin);
  }
};

TEST(OpsGrad, Rope) {
  const std::vector<int32_t> pos = {0, 1, 2, 0, 1, 2, 3, 4, 15, 0, 7};  // restarting, as packed
  const int64_t n = static_cast<int64_t>(pos.size()), heads = 3, max_pos = 16;
  OwnedTensor positions = i32_tensor(pos);
  for (int64_t d : {8, 6}) {
    for (double theta : {10000.0, 7.0}) {
      SCOPED_TRACE(fmt::format("head_dim {} theta {}", d, theta));
      RopeTables t(theta, d, max_pos, DType::f64);
      OwnedTensor x = random_f64(Shape{n, heads, d}, 40), r = random_f64(Shape{n, heads, d}, 41);
      OwnedTensor y(DType::f64, Device::cpu, x->shape());

      // Apply then inverse is the identity.
      copy_tensor(*x, *y);
      ops::rope_apply(*y, *positions, *t.cos, *t.sin, false);
      const std::vector<double> rotated = values_of(*y);
      EXPECT_GT(max_abs_diff(rotated, values_of(*x)), 1e-2);  // it did rotate
      ops::rope_apply(*y, *positions, *t.cos, *t.sin, true);
      EXPECT_LT(max_abs_diff(values_of(*y), values_of(*x)), 1e-14);

      // rotate_half convention with angle = fp32(pos * inv_freq), against a direct formula.
      const std::vector<float> inv = ops::rope_inverse_frequencies(theta, d);
      const int64_t half = d / 2;
      double conv = 0;
      for (int64_t i = 0; i < n; ++i)
        for (int64_t h = 0; h < heads; ++h)
          for (int64_t j = 0; j < half; ++j) {
            EXPECT_NEAR(inv[static_cast<size_t>(j)], std::pow(theta, -2.0 * j / d), 1e-6 * std::pow(theta, -2.0 * j / d));
            const double a = static_cast<double>(static_cast<float>(pos[static_cast<size_t>(i)]) * inv[static_cast<size_t>(j)]);
            const double* xi = x->data<double>() + (i * heads + h) * d;
            const double* yi = rotated.data() + (i * heads + h) * d;
            conv = std::max(conv, std::abs(yi[j] - (xi[j] * std::cos(a) - xi[j + half] * std::sin(a))));
            conv = std::max(conv, std::abs(yi[j + half] - (xi[j + half] * std::cos(a) + xi[j] * std::sin(a))));
          }
      EXPECT_LT(conv, 1e-14);

      // Backward = inverse apply of the output gradient, checked by finite differences.
      const EvalFn eval = [&](std::vector<double>& o) {
        copy_tensor(*x, *y);
        ops::rope_apply(*y, *positions, *t.cos, *t.sin, false);
        o = values_of(*y);
      };
      OwnedTensor dx = copy_of(*r);
      ops::rope_apply(*dx, *positions, *t.cos, *t.sin, true);
      expect_grad("rope dx", *x, values_of(*dx), eval, values_of(*r), kExact);

      RopeTables t32(theta, d, max_pos, DType::f32);
      OwnedTensor x32 = to_f32(*x);
      ops::rope_apply(*x32, *positions, *t32.cos, *t32.sin, false);
      expect_f32_close("rope", values_of(*x32), rotated);
    }
  }
}

// ---- attention -----------------------------------------------------------------------

// Full softmax per query with explicit causal / window / document masks (two passes, no
// online rescaling): the independent oracle for attention_forward.
void naive_attention(const Tensor& q, const Tensor& k, const Tensor& v, const std::vector<int32_t>& cu,
                     const ops::AttentionOptions& o, std::vector<double>& out, std::vector<double>& lse) {
  const int64_t n = q.size(0), hq = q.size(1), hkv = k.size(1), d = q.size(2);
  const double scale = o.scale > 0 ? o.scale : 1 / std::sqrt(static_cast<double>(d));
  out.assign(static_cast<size_t>(n * hq * d), 0);
  lse.assign(static_cast<size_t>(n * hq), 0);
  const double *qp = q.data<double>(), *kp = k.data<double>(), *vp = v.data<double>();
  std::vector<int64_t> doc(static_cast<size_t>(n));
  for (size_t s = 0; s + 1 < cu.size(); ++s)
    for (int32_t i = cu[s]; i < cu[s + 1]; ++i) doc[static_cast<size_t>(i)] = static_cast<int64_t>(s);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t h = 0; h < hq; ++h) {
      const int64_t g = h / (hq / hkv);
      std::vector<double> s(static_cast<size_t>(n), -std::numeric_limits<double>::infinity());
      double m = -std::numeric_limits<double>::infinity();
      for (int64_t j = 0; j < n; ++j) {
        const bool same_doc = doc[static_cast<size_t>(j)] == doc[static_cast<size_t>(i)];
        const bool causal = j <= i;
        const bool in_window = o.window == 0 || i - j < o.window;
        if (!(same_doc && causal && in_window)) continue;
        double dot = 0;
        for (int64_t c = 0; c < d; ++c) dot += qp[(i * hq + h) * d + c] * kp[(j * hkv + g) * d + c];
        double sc = dot * scale;
        if (o.softcap > 0) sc = o.softcap * std::tanh(sc / o.softcap);
        s[static_cast<size_t>(j)] = sc;
        m = std::max(m, sc);
      }
      double sum = 0;
      for (int64_t j = 0; j < n; ++j) sum += std::exp(s[static_cast<size_t>(j)] - m);
      for (int64_t j = 0; j < n; ++j) {
        const double p = std::exp(s[static_cast<size_t>(j)] - m) / sum;
        if (p == 0) continue;
        for (int64_t c = 0; c < d; ++c) out[static_cast<size_t>((i * hq + h) * d + c)] += p * vp[(j * hkv + g) * d + c];
      }
      lse[static_cast<size_t>(i * hq + h)] = m + std::log(sum);
    }
}

struct AttentionCase {
  std::vector<int32_t> lengths;
  int64_t hq, hkv, d;
  ops::AttentionOptions o;
  std::string name() const {
    std::string l;
    for (int32_t x : lengths) l += std::to_string(x) + ",";
    return fmt::format("lengths {} hq {} hkv {} d {} window {} softcap {} scale {}", l, hq, hkv, d, o.window,
                       o.softcap, o.scale);
  }
};

void check_attention(const AttentionCase& c) {
  SCOPED_TRACE(c.name());
  std::vector<int32_t> cu = {0};
  for (int32_t l : c.lengths) cu.push_back(cu.back() + l);
  const int64_t n = cu.back();
  OwnedTensor cu_t = i32_tensor(cu);
  // Scores of a few units, so the softcap (5) and the window both change the result.
  OwnedTensor q = random_f64(Shape{n, c.hq, c.d}, 50 + c.d, 1.5), k = random_f64(Shape{n, c.hkv, c.d}, 51, 1.5),
              v = random_f64(Shape{n, c.hkv, c.d}, 52), r = random_f64(Shape{n, c.hq, c.d}, 53);
  OwnedTensor out = nan_f64(q->shape()), lse = nan_f64(Shape{n, c.hq});
  const EvalFn eval = [&](std::vector<double>& o) {
    ops::attention_forward(*q, *k, *v, *cu_t, c.o, *out, *lse);
    o = values_of(*out);
  };
  std::vector<double> out_ref;
  eval(out_ref);

  std::vector<double> naive_out, naive_lse;
  naive_attention(*q, *k, *v, cu, c.o, naive_out, naive_lse);
  EXPECT_LT(max_rel_diff(out_ref, naive_out, 1.0), 1e-12) << "attention out vs naive";
  EXPECT_LT(max_rel_diff(values_of(*lse), naive_lse, 1.0), 1e-12) << "attention lse vs naive";

  OwnedTensor dq = nan_f64(q->shape()), dk = nan_f64(k->shape()), dv = nan_f64(v->shape());
  ops::attention_backward(*q, *k, *v, *out, *lse, *r, *cu_t, c.o, *dq, *dk, *dv);
  const std::vector<double> weights = values_of(*r);
  expect_grad("attention dq", *q, values_of(*dq), eval, weights, kAttention);
  expect_grad("attention dk", *k, values_of(*dk), eval, weights, kAttention);
  expect_grad("attention dv", *v, values_of(*dv), eval, weights, kAttention);

  OwnedTensor q32 = to_f32(*q), k32 = to_f32(*k), v32 = to_f32(*v);
  OwnedTensor o32(DType::f32, Device::cpu, q->shape()), l32(DType::f32, Device::cpu, Shape{n, c.hq});
  ops::attention_forward(*q32, *k32, *v32, *cu_t, c.o, *o32, *l32);
  expect_f32_close("attention out", values_of(*o32), out_ref);
  expect_f32_close("attention lse", values_of(*l32), naive_lse);
}

TEST(OpsGrad, AttentionPackedGqaWindowSoftcap) {
  for (auto [hq, hkv] : {std::pair<int64_t, int64_t>{2, 2}, {4, 2}, {8, 2}})
    for (int64_t d : {8, 6})
      for (int64_t window : {0, 3})
        for (double softcap : {0.0, 5.0}) {
          AttentionCase c{{1, 5, 17, 3}, hq, hkv, d, {}};
          c.o.window = window;
          c.o.softcap = softcap;
          check_attention(c);
        }
}

TEST(OpsGrad, AttentionEdgeCases) {
  // An empty sequence among others, one kv head shared by 4 query heads, explicit scale.
  AttentionCase empty{{2, 0, 7, 1}, 4, 1, 4, {}};
  empty.o.scale = 0.3;
  check_attention(empty);
  // Window 1 (each query sees only itself) and a window longer than every sequence.
  AttentionCase w1{{3, 4}, 2, 1, 6, {}};
  w1.o.window = 1;
  check_attention(w1);
  AttentionCase wide{{3, 4}, 2, 1, 6, {}};
  wide.o.window = 100;
  wide.o.softcap = 2.0;
  check_attention(wide);
}

TEST(OpsGrad, AttentionNeverCrossesDocuments) {
  // Changing document 0's keys/values must leave document 1's outputs bitwise unchanged.
  const std::vector<int32_t> cu = {0, 5, 11};
  OwnedTensor cu_t = i32_tensor(cu);
  OwnedTensor q = random_f64(Shape{11, 2, 4}, 60), k = random_f64(Shape{11, 1, 4}, 61), v = random_f64(Shape{11, 1, 4}, 62);
  OwnedTensor out = nan_f64(q->shape()), lse = nan_f64(Shape{11, 2});
  ops::attention_forward(*q, *k, *v, *cu_t, {}, *out, *lse);
  const std::vector<double> before = values_of(out->rows(5, 11));
  for (int64_t i = 0; i < 5 * 4; ++i) k->data<double>()[i] += 3, v->data<double>()[i] -= 2;
  ops::attention_forward(*q, *k, *v, *cu_t, {}, *out, *lse);
  EXPECT_EQ(max_abs_diff(values_of(out->rows(5, 11)), before), 0.0);
}

// ---- swiglu --------------------------------------------------------------------------

TEST(OpsGrad, Swiglu) {
  const int64_t n = 5, f = 7;
  OwnedTensor gu = random_f64(Shape{n, 2 * f}, 70, 2.0), r = random_f64(Shape{n, f}, 71);
  OwnedTensor out = nan_f64(Shape{n, f});
  const EvalFn eval = [&](std::vector<double>& o) {
    ops::swiglu_forward(*gu, *out);
    o = values_of(*out);
  };
  std::vector<double> ref;
  eval(ref);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < f; ++j) {
      const double g = gu->data<double>()[i * 2 * f + j], u = gu->data<double>()[i * 2 * f + f + j];
      EXPECT_NEAR(ref[static_cast<size_t>(i * f + j)], g / (1 + std::exp(-g)) * u, 1e-14);
    }
  OwnedTensor dgu = nan_f64(gu->shape());
  ops::swiglu_backward(*gu, *r, *dgu);
  expect_grad("swiglu dgate_up", *gu, values_of(*dgu), eval, values_of(*r), kExact);
  // The backward that rebuilds the output over its input gradient (the MLP's recompute):
  // the same gradient, and the forward's output to the bit.
  OwnedTensor dgu2 = nan_f64(gu->shape()), r_then_out = copy_of(*r);
  ops::swiglu_backward(*gu, *r_then_out, *dgu2, *r_then_out);
  EXPECT_EQ(max_abs_diff(values_of(*dgu2), values_of(*dgu)), 0.0);
  EXPECT_EQ(max_abs_diff(values_of(*r_then_out), ref), 0.0);
  OwnedTensor gu32 = to_f32(*gu), o32(DType::f32, Device::cpu, Shape{n, f});
  ops::swiglu_forward(*gu32, *o32);
  expect_f32_close("swiglu", values_of(*o32), ref);
}

// ---- qkv split / merge ---------------------------------------------------------------

TEST(OpsGrad, QkvSplitMerge) {
  const int64_t n = 5, hq = 4, hkv = 2, d = 3, cols = (hq + 2 * hkv) * d;
  OwnedTensor qkv = random_f64(Shape{n, cols}, 80);
  OwnedTensor q = nan_f64(Shape{n, hq, d}), k = nan_f64(Shape{n, hkv, d}), v = nan_f64(Shape{n, hkv, d});
  OwnedTensor rq = random_f64(q->shape(), 81), rk = random_f64(k->shape(), 82), rv = random_f64(v->shape(), 83);
  auto concat = [](std::vector<double> a, const std::vector<double>& b, const std::vector<double>& c) {
    a.insert(a.end(), b.begin(), b.end());
    a.insert(a.end(), c.begin(), c.end());
    return a;
  };
  const EvalFn split = [&](std::vector<double>& o) {
    ops::qkv_split(*qkv, *q, *k, *v);
    o = concat(values_of(*q), values_of(*k), values_of(*v));
  };
  std::vector<double> parts;
  split(parts);
  // Layout: row i = [q heads | k heads | v heads].
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_EQ(q->data<double>()[i * hq * d + 5], qkv->data<double>()[i * cols + 5]);
    EXPECT_EQ(k->data<double>()[i * hkv * d + 1], qkv->data<double>()[i * cols + hq * d + 1]);
    EXPECT_EQ(v->data<double>()[i * hkv * d + 4], qkv->data<double>()[i * cols + (hq + hkv) * d + 4]);
  }
  // d split / d qkv is merge.
  OwnedTensor dqkv = nan_f64(qkv->shape());
  ops::qkv_merge(*rq, *rk, *rv, *dqkv);
  expect_grad("qkv_split", *qkv, values_of(*dqkv), split, concat(values_of(*rq), values_of(*rk), values_of(*rv)),
              kExact);
  // d merge / d(q, k, v) is split.
  OwnedTensor r = random_f64(qkv->shape(), 84), fused = nan_f64(qkv->shape());
  const EvalFn merge = [&](std::vector<double>& o) {
    ops::qkv_merge(*rq, *rk, *rv, *fused);
    o = values_of(*fused);
  };
  OwnedTensor gq = nan_f64(q->shape()), gk = nan_f64(k->shape()), gv = nan_f64(v->shape());
  ops::qkv_split(*r, *gq, *gk, *gv);
  expect_grad("qkv_merge dq", *rq, values_of(*gq), merge, values_of(*r), kExact);
  expect_grad("qkv_merge dk", *rk, values_of(*gk), merge, values_of(*r), kExact);
  expect_grad("qkv_merge dv", *rv, values_of(*gv), merge, values_of(*r), kExact);
  // merge(split(x)) == x exactly.
  ops::qkv_merge(*q, *k, *v, *fused);
  EXPECT_EQ(max_abs_diff(values_of(*fused), values_of(*qkv)), 0.0);
}

// ---- qkv_prepare (fused q/k norm + RoPE + split) --------------------------------------

TEST(OpsGrad, QkvPrepare) {
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
    auto concat = [](std::vector<double> a, const std::vector<double>& b, const std::vector<double>& c) {
      a.insert(a.end(), b.begin(), b.end());
      a.insert(a.end(), c.begin(), c.end());
      return a;
    };
    const EvalFn eval = [&](std::vector<double>& o) {
      ops::qkv_prepare_forward(*qkv, p, *q, *k, *v);
      o = concat(values_of(*q), values_of(*k), values_of(*v));
    };
    std::vector<double> prepared;
    eval(prepared);

    // The same numbers as the unfused ops it replaces: split, per-head RMSNorm, rotation.
    OwnedTensor sq = nan_f64(q->shape()), sk = nan_f64(k->shape()), sv = nan_f64(v->shape());
    ops::qkv_split(*qkv, *sq, *sk, *sv);
    for (auto [part, gain, heads] : {std::tuple{&sq, &q_gain, hq}, {&sk, &k_gain, hkv}}) {
      OwnedTensor& x = *part;
      if (norm) {
        OwnedTensor normed = nan_f64(x->shape()), rstd = nan_f64(Shape{n * heads});
        ops::rms_norm_forward(x->view(Shape{n * heads, d}), **gain, eps, normed->view(Shape{n * heads, d}), *rstd);
        x = std::move(normed);
      }
      if (rope) ops::rope_apply(*x, *positions, *t.cos, *t.sin, false);
    }
    EXPECT_EQ(max_abs_diff(prepared, concat(values_of(*sq), values_of(*sk), values_of(*sv))), 0.0);

    // Gradients by finite differences: the projection and (accumulated) gains.
    OwnedTensor rq = random_f64(q->shape(), 93), rk = random_f64(k->shape(), 94), rv = random_f64(v->shape(), 95);
    const std::vector<double> weights = concat(values_of(*rq), values_of(*rk), values_of(*rv));
    OwnedTensor dqkv = nan_f64(qkv->shape());
    OwnedTensor dq_gain0 = random_f64(Shape{d}, 96), dk_gain0 = random_f64(Shape{d}, 97);
    OwnedTensor dq_gain = copy_of(*dq_gain0), dk_gain = copy_of(*dk_gain0);
    ops::qkv_prepare_backward(*qkv, p, *rq, *rk, *rv, *dqkv, *dq_gain, *dk_gain);
    expect_grad("qkv_prepare dqkv", *qkv, values_of(*dqkv), eval, weights, kNorm);
    if (norm) {
      expect_grad("qkv_prepare dq_gain", *q_gain, minus(*dq_gain, *dq_gain0), eval, weights, kNorm);
      expect_grad("qkv_prepare dk_gain", *k_gain, minus(*dk_gain, *dk_gain0), eval, weights, kNorm);
    } else {
      EXPECT_EQ(max_abs_diff(values_of(*dq_gain), values_of(*dq_gain0)), 0.0);  // no gains: untouched
    }
  }
}

TEST(OpsGrad, QkvPrepareRejectsBadInput) {
  OwnedTensor qkv = random_f64(Shape{3, 4 * 4}, 98), q = nan_f64(Shape{3, 2, 4}), k = nan_f64(Shape{3, 1, 4}),
              v = nan_f64(Shape{3, 1, 4});
  ops::QkvPrepare p;
  p.q_heads = 2, p.kv_heads = 1, p.head_dim = 4;
  RopeTables t(10000.0, 4, 2, DType::f64);
  OwnedTensor far = i32_tensor({0, 1, 2});  // 2 is outside a table of 2 positions
  p.cos = *t.cos, p.sin = *t.sin, p.positions = *far;
  EXPECT_THROW(ops::qkv_prepare_forward(*qkv, p, *q, *k, *v), Error);
  OwnedTensor near = i32_tensor({0, 1, 1});
  p.positions = *near;
  ops::qkv_prepare_forward(*qkv, p, *q, *k, *v);
  p.head_dim = 3;  // odd, and no longer fits qkv
  EXPECT_THROW(ops::qkv_prepare_forward(*qkv, p, *q, *k, *v), Error);
}

// ---- lm_head_loss --------------------------------------------------------------------

struct NaiveLoss {
  double loss = 0, z = 0;
  int64_t count = 0;
};

// Full [N, V] logits at once, softcap, log-sum-exp: the oracle for the chunked loss.
NaiveLoss naive_lm_head_loss(const Tensor& h, const Tensor& w, const std::vector<int32_t>& targets, double softcap) {
  const int64_t n = h.size(0), d = h.size(1), vocab = w.size(0);
  std::vector<double> logits(static_cast<size_t>(n * vocab));
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < vocab; ++j) {
      double s = 0;
      for (int64_t c = 0; c < d; ++c) s += h.data<double>()[i * d + c] * w.data<double>()[j * d + c];
      logits[static_cast<size_t>(i * vocab + j)] = softcap > 0 ? softcap * std::tanh(s / softcap) : s;
    }
  NaiveLoss r;
  for (int64_t i = 0; i < n; ++i) {
    if (targets[static_cast<size_t>(i)] < 0) continue;
    const double* row = logits.data() + i * vocab;
    double m = row[0], sum = 0;
    for (int64_t j = 1; j < vocab; ++j) m = std::max(m, row[j]);
    for (int64_t j = 0; j < vocab; ++j) sum += std::exp(row[j] - m);
    const double lse = m + std::log(sum);
    r.loss += lse - row[targets[static_cast<size_t>(i)]];
    r.z += lse * lse;
    ++r.count;
  }
  return r;
}

struct HeadScratch {
  OwnedTensor logits, stats;
  HeadScratch(int64_t chunk, int64_t vocab, DType dtype)
      : logits(dtype, Device::cpu, Shape{chunk, vocab}), stats(DType::f64, Device::cpu, Shape{chunk, 2}) {
    if (dtype == DType::f64) std::fill_n(logits->data<double>(), chunk * vocab, std::nan(""));
  }
  ops::LmHeadScratch get() const { return {*logits, *stats}; }
};

TEST(OpsGrad, LmHeadLoss) {
  const int64_t n = 13, d = 6, vocab = 11;
  const std::vector<int32_t> tgt = {3, 0, -1, 10, 7, 7, 1, -1, 2, 9, 4, 5, -1};  // last row of the last chunk ignored
  OwnedTensor targets = i32_tensor(tgt);
  OwnedTensor h = random_f64(Shape{n, d}, 90), w = random_f64(Shape{vocab, d}, 91, 0.8);
  for (double z : {0.0, 1e-2})
    for (double softcap : {0.0, 3.0})
      for (int64_t chunk : {13, 5, 4, 20}) {
        SCOPED_TRACE(fmt::format("z {} softcap {} chunk {}", z, softcap, chunk));
        ops::LmHeadLossOptions o;
        o.chunk_rows = chunk;
        o.z_loss = z;
        o.softcap = softcap;
        o.loss_scale = 1.0 / 10;  // 1 / target count
        HeadScratch s(chunk, vocab, DType::f64);
        const auto objective = [&] {
          const ops::LossSums sums = ops::lm_head_loss(*h, *w, *targets, o, s.get(), Tensor(), Tensor());
          return o.loss_scale * (sums.loss + z * sums.z);
        };
        const ops::LossSums eval_sums = ops::lm_head_loss(*h, *w, *targets, o, s.get(), Tensor(), Tensor());
        const NaiveLoss naive = naive_lm_head_loss(*h, *w, tgt, softcap);
        EXPECT_EQ(eval_sums.count, 10);
        EXPECT_EQ(naive.count, 10);
        EXPECT_NEAR(eval_sums.loss, naive.loss, 1e-12 * std::abs(naive.loss));
        EXPECT_NEAR(eval_sums.z, naive.z, 1e-12 * std::abs(naive.z));

        OwnedTensor dh = nan_f64(h->shape()), dw0 = random_f64(w->shape(), 92), dw = copy_of(*dw0);
        const ops::LossSums sums = ops::lm_head_loss(*h, *w, *targets, o, s.get(), *dh, *dw);
        EXPECT_NEAR(sums.loss, eval_sums.loss, 1e-13 * std::abs(eval_sums.loss));
        EXPECT_NEAR(sums.z, eval_sums.z, 1e-13 * std::abs(eval_sums.z));
        const std::vector<double> gh = values_of(*dh), gw = minus(*dw, *dw0);
        for (int64_t i = 0; i < n; ++i)  // ignored rows get exactly zero gradient
          if (tgt[static_cast<size_t>(i)] < 0) {
            for (int64_t c = 0; c < d; ++c) EXPECT_EQ(gh[static_cast<size_t>(i * d + c)], 0.0) << "row " << i;
          }
        const EvalFn eval = [&](std::vector<double>& out) { out.assign(1, objective()); };
        expect_grad("lm_head_loss dh", *h, gh, eval, {1.0}, kScalar);
        expect_grad("lm_head_loss dw", *w, gw, eval, {1.0}, kScalar);

        // dh alone and dw alone give the same gradients as both together.
        OwnedTensor dh_only = nan_f64(h->shape()), dw_only = filled_f64(w->shape(), 0);
        ops::lm_head_loss(*h, *w, *targets, o, s.get(), *dh_only, Tensor());
        ops::lm_head_loss(*h, *w, *targets, o, s.get(), Tensor(), *dw_only);
        EXPECT_LT(max_abs_diff(values_of(*dh_only), gh), 1e-15);
        EXPECT_LT(max_abs_diff(values_of(*dw_only), gw), 1e-14);

        // f32 forward.
        OwnedTensor h32 = to_f32(*h), w32 = to_f32(*w);
        HeadScratch s32(chunk, vocab, DType::f32);
        const ops::LossSums f32 = ops::lm_head_loss(*h32, *w32, *targets, o, s32.get(), Tensor(), Tensor());
        EXPECT_NEAR(f32.loss, eval_sums.loss, kF32Tol * std::abs(eval_sums.loss));
        EXPECT_NEAR(f32.z, eval_sums.z, kF32Tol * std::abs(eval_sums.z));
      }
}

TEST(OpsGrad, LmHeadLogits) {
  const int64_t m = 3, d = 6, vocab = 11;
  OwnedTensor h = random_f64(Shape{m, d}, 93), w = random_f64(Shape{vocab, d}, 94, 0.8);
  for (double softcap : {0.0, 3.0}) {
    OwnedTensor logits = nan_f64(Shape{m, vocab});
    ops::lm_head_logits(*h, *w, softcap, *logits);
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < vocab; ++j) {
        double s = 0;
        for (int64_t c = 0; c < d; ++c) s += h->data<double>()[i * d + c] * w->data<double>()[j * d + c];
        if (softcap > 0) s = softcap * std::tanh(s / softcap);
        EXPECT_NEAR(logits->data<double>()[i * vocab + j], s, 1e-13);
      }
  }
}

}  // namespace
}  // namespace kiln

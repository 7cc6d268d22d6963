// The per-token pieces of the KDA mixer (ops/kda/kda_mixer_ops.h) against central finite
// differences in f64 (five-point stencil, L = sum(out * R)): the split with q and k
// L2-normalized per head, beta's sigmoid, and the gated per-head RMSNorm with its gain.
#include "grad_check.h"
#include "ops/kda/kda_mixer_ops.h"
#include "test_util.h"

#include <gtest/gtest.h>

#include <cmath>

namespace kiln {
namespace {

using namespace kiln::test;

GradCheckOptions tight() {
  GradCheckOptions o;
  o.order = 4, o.eps = 1e-4, o.floor = 1e-4, o.tol = 1e-8;
  return o;
}

TEST(KdaMixerOps, SplitNormGradientMatchesFiniteDifferences) {
  const int64_t n = 5, h = 2, dk = 3, dv = 4;
  OwnedTensor qkv = random_f64(Shape{n, h * (2 * dk + dv)}, 1);
  OwnedTensor q = nan_f64(Shape{n, h, dk}), k = nan_f64(Shape{n, h, dk}), v = nan_f64(Shape{n, h, dv});
  ops::kda_split_norm_forward(process_exec(), *qkv, *q, *k, *v);
  for (int64_t r = 0; r < n * h; ++r) {  // unit rows (up to eps)
    double ss = 0;
    for (int64_t i = 0; i < dk; ++i) ss += std::pow(k->data<double>()[r * dk + i], 2);
    EXPECT_NEAR(ss, 1.0, 1e-5);
  }
  OwnedTensor rq = random_f64(q->shape(), 2), rk = random_f64(k->shape(), 3), rv = random_f64(v->shape(), 4);
  OwnedTensor dqkv = nan_f64(qkv->shape());
  ops::kda_split_norm_backward(process_exec(), *qkv, *rq, *rk, *rv, *dqkv);
  std::vector<double> weights = values_of(*rq);
  for (const Tensor* r : {&*rk, &*rv})
    for (double w : values_of(*r)) weights.push_back(w);
  const auto eval = [&](std::vector<double>& out) {
    ops::kda_split_norm_forward(process_exec(), *qkv, *q, *k, *v);
    out = values_of(*q);
    for (const Tensor* t : {&*k, &*v})
      for (double x : values_of(*t)) out.push_back(x);
  };
  const GradCheckReport rep = check_gradient(*qkv, values_of(*dqkv), eval, weights, tight());
  EXPECT_TRUE(rep.ok()) << rep.str();
}

TEST(KdaMixerOps, BetaGradientMatchesFiniteDifferences) {
  OwnedTensor raw = random_f64(Shape{6, 3}, 5, 3.0), beta = nan_f64(Shape{6, 3}), r = random_f64(Shape{6, 3}, 6);
  OwnedTensor draw = nan_f64(Shape{6, 3});
  ops::kda_beta_backward(process_exec(), *raw, *r, *draw);
  const auto eval = [&](std::vector<double>& out) {
    ops::kda_beta_forward(process_exec(), *raw, *beta);
    out = values_of(*beta);
  };
  const GradCheckReport rep = check_gradient(*raw, values_of(*draw), eval, values_of(*r), tight());
  EXPECT_TRUE(rep.ok()) << rep.str();
}

TEST(KdaMixerOps, OutputGateGradientsMatchFiniteDifferences) {
  const int64_t n = 4, h = 3, dv = 5;
  OwnedTensor o = random_f64(Shape{n, h, dv}, 7), gain = random_f64(Shape{dv}, 8), gate = random_f64(Shape{n, h * dv}, 9);
  for (int64_t i = 0; i < dv; ++i) gain->data<double>()[i] += 1.0;
  OwnedTensor r = random_f64(Shape{n, h * dv}, 10), y = nan_f64(Shape{n, h * dv});
  OwnedTensor d_o = nan_f64(o->shape()), dgate = nan_f64(gate->shape()), dgain = filled_f64(Shape{dv}, 0.0);
  const double eps = 1e-5;
  ops::kda_output_gate_backward(process_exec(), *o, *gain, *gate, eps, *r, *d_o, *dgate, *dgain);
  const auto eval = [&](std::vector<double>& out) {
    ops::kda_output_gate_forward(process_exec(), *o, *gain, *gate, eps, *y);
    out = values_of(*y);
  };
  for (const auto& [name, x, d] : {std::tuple{"o", &o, &d_o}, {"gate", &gate, &dgate}, {"gain", &gain, &dgain}}) {
    const GradCheckReport rep = check_gradient(**x, values_of(**d), eval, values_of(*r), tight());
    EXPECT_TRUE(rep.ok()) << name << ": " << rep.str();
  }
}

}  // namespace
}  // namespace kiln

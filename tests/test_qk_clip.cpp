// QK-Clip (ops/attention/qk_clip.h, nn/qk_clip.h): the logit keys' order, the per-head
// maximum logit against every visible pair, the factors of each sharing rule, the row
// scaling, and in a model: after a clip of a step whose weights did not otherwise move,
// the same batch's largest logit is tau, under every q/k form (per head, grouped-query,
// q/k norms as RMSNorm, Gemma's and DyT), and nothing moves when no head exceeds tau.
#include "grad_check.h"
#include "test_util.h"
#include "tiny_model.h"

#include "ops/attention/logit_key.h"
#include "ops/attention/max_logit.h"
#include "ops/attention/qk_clip.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <string>

namespace kiln {
namespace {

using test::init_tiny_model;
using test::pack_docs;
using test::tiny_build;
using test::tiny_config;
using test::values_of;

constexpr float kInf = std::numeric_limits<float>::infinity();

TEST(LogitKey, IntegerOrderIsTheFloatOrderAndZeroIsBelowAll) {
  const std::vector<float> sorted = {-kInf, -3e38f, -100.5f, -1.0f, -1e-30f, 0.0f, 1e-30f, 0.5f, 99.75f, 3e38f, kInf};
  EXPECT_LT(0u, ops::logit_key(-kInf));
  for (size_t i = 0; i < sorted.size(); ++i) {
    EXPECT_EQ(ops::logit_of_key(ops::logit_key(sorted[i])), sorted[i]) << sorted[i];
    if (i > 0) EXPECT_LT(ops::logit_key(sorted[i - 1]), ops::logit_key(sorted[i])) << sorted[i];
  }
  EXPECT_EQ(ops::logit_of_key(0), -kInf);
}

// The largest scale q_i . k_j of each head over the pairs i sees: a brute force over every
// (i, j) with the mask written out (same sequence, j <= i, inside the window).
std::vector<double> brute_force_max(const Tensor& q, const Tensor& k, const std::vector<int32_t>& cu, int64_t window) {
  const int64_t n = q.size(0), hq = q.size(1), hkv = k.size(1), d = q.size(2);
  auto seq_of = [&](int64_t i) { return std::upper_bound(cu.begin(), cu.end(), i) - cu.begin(); };
  std::vector<double> best(static_cast<size_t>(hq), -INFINITY);
  for (int64_t h = 0; h < hq; ++h)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < n; ++j) {
        if (seq_of(i) != seq_of(j) || j > i || (window > 0 && i - j >= window)) continue;
        double dot = 0;
        for (int64_t c = 0; c < d; ++c)
          dot += q.data<double>()[(i * hq + h) * d + c] * k.data<double>()[(j * hkv + h / (hq / hkv)) * d + c];
        best[h] = std::max(best[h], dot / std::sqrt(static_cast<double>(d)));
      }
  return best;
}

OwnedTensor cu_tensor(const std::vector<int32_t>& cu) {
  OwnedTensor t(DType::i32, Device::cpu, Shape{static_cast<int64_t>(cu.size())});
  std::copy(cu.begin(), cu.end(), t->data<int32_t>());
  return t;
}

TEST(MaxLogit, EachHeadsMaximumOverItsVisiblePairsAcrossSequencesAndWindows) {
  const OwnedTensor q = test::random_tensor(DType::f64, Shape{13, 4, 8}, 1, 2.0);
  const OwnedTensor k = test::random_tensor(DType::f64, Shape{13, 2, 8}, 2, 2.0);
  const std::vector<int32_t> cu = {0, 5, 5, 13};  // an empty sequence between two
  for (const int64_t window : {0, 1, 3}) {
    OwnedTensor running(DType::i32, Device::cpu, Shape{4});
    zero_tensor(*running);
    ops::AttentionOptions o;
    o.window = window;
    o.softcap = 5;  // not applied: the measure is of the raw logits
    ops::attention_max_logits(process_exec(), *q, *k, *cu_tensor(cu), o, *running);
    const std::vector<float> got = ops::read_max_logits(process_exec(), *running);
    const std::vector<double> want = brute_force_max(*q, *k, cu, window);
    for (size_t h = 0; h < 4; ++h) EXPECT_NEAR(got[h], want[h], 1e-6 * std::abs(want[h])) << "window " << window << " head " << h;
    // A second batch raises a head's maximum only where it is larger.
    const OwnedTensor k2 = test::random_tensor(DType::f64, Shape{13, 2, 8}, 3, 2.0);
    ops::attention_max_logits(process_exec(), *q, *k2, *cu_tensor(cu), o, *running);
    const std::vector<double> want2 = brute_force_max(*q, *k2, cu, window);
    const std::vector<float> both = ops::read_max_logits(process_exec(), *running);
    for (size_t h = 0; h < 4; ++h) EXPECT_NEAR(both[h], std::max(want[h], want2[h]), 1e-6 * std::abs(want2[h]));
    OwnedTensor last(DType::i32, Device::cpu, Shape{4});
    ops::take_max_logits(process_exec(), *running, *last);
    EXPECT_EQ(ops::read_max_logits(process_exec(), *last), both);
    for (const float m : ops::read_max_logits(process_exec(), *running)) EXPECT_EQ(m, -kInf);
  }
}

OwnedTensor keys_of(const std::vector<float>& max) {
  OwnedTensor t(DType::i32, Device::cpu, Shape{static_cast<int64_t>(max.size())});
  for (size_t h = 0; h < max.size(); ++h) t->data<int32_t>()[h] = static_cast<int32_t>(ops::logit_key(max[h]));
  return t;
}

std::vector<float> factors(ops::QkClipSharing sharing, int64_t q_count, int64_t k_count, std::vector<float>* k_out) {
  const OwnedTensor keys = keys_of({2.0f, 5.0f, 10.0f, -3.0f});
  OwnedTensor qf(DType::f32, Device::cpu, Shape{q_count}), kf(DType::f32, Device::cpu, Shape{k_count});
  ops::qk_clip_factors(process_exec(), *keys, 4.0, sharing, *qf, *kf);
  k_out->assign(kf->data<float>(), kf->data<float>() + k_count);
  return {qf->data<float>(), qf->data<float>() + q_count};
}

TEST(QkClipFactors, EachSharingSplitsGammaAsDocumented) {
  std::vector<float> k;
  // gamma = tau / max over tau: 1, 0.8, 0.4, 1.
  EXPECT_EQ(factors(ops::QkClipSharing::per_head, 4, 4, &k),
            (std::vector<float>{1.0f, std::sqrt(0.8f), std::sqrt(0.4f), 1.0f}));
  EXPECT_EQ(k, (std::vector<float>{1.0f, std::sqrt(0.8f), std::sqrt(0.4f), 1.0f}));
  EXPECT_EQ(factors(ops::QkClipSharing::shared_keys, 4, 2, &k), (std::vector<float>{1.0f, 0.8f, 0.4f, 1.0f}));
  EXPECT_EQ(k, (std::vector<float>{1.0f, 1.0f}));
  EXPECT_EQ(factors(ops::QkClipSharing::shared_gains, 1, 1, &k), (std::vector<float>{std::sqrt(0.4f)}));
  EXPECT_EQ(k, (std::vector<float>{std::sqrt(0.4f)}));
  // No logit measured yet: nothing clips.
  OwnedTensor empty(DType::i32, Device::cpu, Shape{2}), qf(DType::f32, Device::cpu, Shape{2}),
      kf(DType::f32, Device::cpu, Shape{2});
  zero_tensor(*empty);
  ops::qk_clip_factors(process_exec(), *empty, 4.0, ops::QkClipSharing::per_head, *qf, *kf);
  EXPECT_EQ(values_of(*qf), (std::vector<double>{1.0, 1.0}));
}

TEST(ScaleHeadRows, RowsOfEachHeadTakeItsFactorAndGainsTheirOffsetForm) {
  OwnedTensor w(DType::f32, Device::cpu, Shape{4, 3}), f(DType::f32, Device::cpu, Shape{2});
  for (int64_t i = 0; i < 12; ++i) w->data<float>()[i] = static_cast<float>(i + 1);
  f->data<float>()[0] = 0.5f, f->data<float>()[1] = 2.0f;
  ops::scale_head_rows(process_exec(), *w, *f, 2);  // rows 0-1 by 0.5, rows 2-3 by 2
  EXPECT_EQ(values_of(*w), (std::vector<double>{0.5, 1, 1.5, 2, 2.5, 3, 14, 16, 18, 20, 22, 24}));
  OwnedTensor gain(DType::f32, Device::cpu, Shape{3}), one(DType::f32, Device::cpu, Shape{1});
  gain->data<float>()[0] = 0.0f, gain->data<float>()[1] = 1.0f, gain->data<float>()[2] = -0.5f;
  one->data<float>()[0] = 0.5f;
  ops::scale_head_rows(process_exec(), *gain, *one, 3, /*gain_offset=*/true);  // 1 + w halved
  EXPECT_EQ(values_of(*gain), (std::vector<double>{-0.5, 0.0, -0.75}));
  EXPECT_NE(test::error_of([&] { ops::scale_head_rows(process_exec(), *w, *f, 3); }).find("not whole heads"), std::string::npos);
}

// The model's largest logit (over layers) and clipped heads of the last step, from its report.
std::pair<double, double> last_step_logits(const Model& m) {
  double largest = -INFINITY, clipped = 0;
  for (const auto& [name, value] : m.component_metrics()) {
    if (name.ends_with(".max_logit")) largest = std::max(largest, value);
    if (name.ends_with(".clipped")) clipped += value;
  }
  return {largest, clipped};
}

struct ClipRun {
  double before = 0, after = 0, clipped = 0;
  std::map<std::string, std::vector<double>> weights_before, weights_after;
};

// Two training forwards of one batch with a clip between them and no optimizer step: the
// largest logit before, and after the clip.
ClipRun clip_between_forwards(const ModelConfig& c, double tau) {
  BuildOptions o = tiny_build();
  o.qk_clip_tau = tau;
  Model m(c, o);
  m.allocate();
  init_tiny_model(m, 5);
  ClipRun r;
  for (const auto& p : m.parameters()) r.weights_before[p->name()] = values_of(p->value());
  m.load_batch(pack_docs(test::three_docs(), 4));
  m.zero_grads();
  m.forward_backward(0.05);
  m.after_step(true);
  std::tie(r.before, r.clipped) = last_step_logits(m);
  for (const auto& p : m.parameters()) r.weights_after[p->name()] = values_of(p->value());
  m.forward_backward(0.05);
  m.after_step(false);  // the report's maxima, without another clip
  r.after = last_step_logits(m).first;
  return r;
}

ModelConfig with_qk(bool qk_norm, int64_t kv_heads, const std::string& qk_type = "rmsnorm") {
  ModelConfig c = tiny_config(qk_norm, false);
  c.kv_heads = kv_heads;
  c.qk_norm_type = qk_type;
  return c;
}

TEST(QkClip, AfterAClipTheBatchsLargestLogitIsTauUnderEveryQkForm) {
  const std::vector<std::pair<std::string, ModelConfig>> forms = {
      {"per-head keys", with_qk(false, 4)},        {"grouped-query", with_qk(false, 2)},
      {"q/k RMSNorm", with_qk(true, 2)},           {"q/k Gemma RMSNorm", with_qk(true, 2, "gemma_rmsnorm")},
      {"q/k DyT", with_qk(true, 2, "dyt")}};
  for (const auto& [form, config] : forms) {
    const double largest = clip_between_forwards(config, 1e30).before;
    ASSERT_TRUE(std::isfinite(largest) && largest > 0) << form << ": " << largest;
    const double tau = 0.5 * largest;
    const ClipRun r = clip_between_forwards(config, tau);
    EXPECT_NEAR(r.before, largest, 1e-6 * largest) << form;
    EXPECT_GE(r.clipped, 1) << form;
    EXPECT_NEAR(r.after, tau, 1e-5 * tau) << form;
    // Only the attention's q/k weights (and biases, norms) moved.
    for (const auto& [name, before] : r.weights_before) {
      const bool qk = name.find("q_") != std::string::npos || name.find("k_") != std::string::npos;
      if (!qk) EXPECT_EQ(r.weights_after.at(name), before) << form << ": " << name;
    }
  }
}

TEST(QkClip, NoHeadOverTauMovesNoWeight) {
  for (const ModelConfig& c : {with_qk(false, 2), with_qk(true, 2)}) {
    const ClipRun r = clip_between_forwards(c, 1e30);
    EXPECT_EQ(r.clipped, 0);
    EXPECT_EQ(r.weights_after, r.weights_before);
    EXPECT_EQ(r.after, r.before);
  }
}

}  // namespace
}  // namespace kiln

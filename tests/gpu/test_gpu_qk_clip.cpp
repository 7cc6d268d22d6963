// QK-Clip on the GPU against the CPU reference: the per-head maximum logit of bf16 q/k
// (tensor-core tiles at head_dim 64, 128 and 256, the plain kernel otherwise and in fp32)
// over ragged sequences, empty ones and windows; the factors and the row scaling bit for
// bit; and in a bf16 model, the clip bringing the batch's largest logit down to tau.
#include "gpu/bf16_tensors.h"
#include "gpu/gpu_harness.h"
#include "test_util.h"
#include "tiny_model.h"

#include "ops/attention/logit_key.h"
#include "ops/attention/max_logit.h"
#include "ops/attention/qk_clip.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace kiln {
namespace {

using namespace gpu_test;

class GpuQkClip : public GpuTest {};

OwnedTensor i32_tensor(const std::vector<int32_t>& v) {
  OwnedTensor t(DType::i32, Device::cpu, Shape{static_cast<int64_t>(v.size())});
  std::copy(v.begin(), v.end(), t->data<int32_t>());
  return t;
}

OwnedTensor zero_keys(int64_t heads, Device device) {
  OwnedTensor t(DType::i32, device, Shape{heads});
  const OwnedTensor host = i32_tensor(std::vector<int32_t>(static_cast<size_t>(heads), 0));
  copy_tensor(*host, *t);
  return t;
}

TEST_F(GpuQkClip, MaxLogitsMatchTheCpuOverRaggedSequencesAndWindows) {
  // 333 rows (not a multiple of the kernel's 64), an empty sequence, one shorter than a tile.
  const std::vector<int32_t> cu = {0, 37, 37, 200, 333};
  const int64_t n = 333, hq = 4, hkv = 2;
  for (const int64_t d : {64, 128, 256, 32}) {
    for (const bool bf16 : {true, false}) {
      for (const int64_t window : {0, 50}) {
        OwnedTensor q = test::random_tensor(DType::f32, Shape{n, hq, d}, 10 + d, 1.0);
        OwnedTensor k = test::random_tensor(DType::f32, Shape{n, hkv, d}, 20 + d, 1.0);
        if (bf16) round_to_bf16(*q), round_to_bf16(*k);
        ops::AttentionOptions o;
        o.window = window;
        OwnedTensor cpu_keys = zero_keys(hq, Device::cpu);
        ops::attention_max_logits(process_exec(), *to_f64(*q), *to_f64(*k), *i32_tensor(cu), o, *cpu_keys);
        const OwnedTensor dq = bf16 ? to_device(*bf16_of(*q)) : to_device(*q);
        const OwnedTensor dk = bf16 ? to_device(*bf16_of(*k)) : to_device(*k);
        OwnedTensor gpu_keys = zero_keys(hq, Device::cuda);
        ops::attention_max_logits(process_exec(), *dq, *dk, *to_device(*i32_tensor(cu)), o, *gpu_keys);
        const std::vector<float> want = ops::read_max_logits(process_exec(), *cpu_keys), got = ops::read_max_logits(process_exec(), *gpu_keys);
        for (int64_t h = 0; h < hq; ++h) {
          // fp32 sums of d products of unit-scale values: a few ulps of sqrt(d) each.
          EXPECT_NEAR(got[h], want[h], 2e-5 * std::sqrt(static_cast<double>(d)))
              << "d " << d << (bf16 ? " bf16" : " fp32") << " window " << window << " head " << h;
        }
      }
    }
  }
}

TEST_F(GpuQkClip, FactorsAndRowScalingAreTheCpusBits) {
  std::vector<int32_t> keys;
  for (const float m : {2.0f, 5.0f, 10.0f, -3.0f, 7.3f, 4.0f}) keys.push_back(static_cast<int32_t>(ops::logit_key(m)));
  keys.push_back(0);  // a head without a logit
  keys.push_back(static_cast<int32_t>(ops::logit_key(123.456f)));
  const OwnedTensor host_keys = i32_tensor(keys);
  const OwnedTensor dev_keys = to_device(*host_keys);
  struct Form {
    ops::QkClipSharing sharing;
    int64_t q, k;
  };
  for (const Form f : {Form{ops::QkClipSharing::per_head, 8, 8}, Form{ops::QkClipSharing::shared_keys, 8, 2},
                       Form{ops::QkClipSharing::shared_gains, 1, 1}}) {
    OwnedTensor qf(DType::f32, Device::cpu, Shape{f.q}), kf(DType::f32, Device::cpu, Shape{f.k});
    OwnedTensor dqf(DType::f32, Device::cuda, Shape{f.q}), dkf(DType::f32, Device::cuda, Shape{f.k});
    ops::qk_clip_factors(process_exec(), *host_keys, 4.0, f.sharing, *qf, *kf);
    ops::qk_clip_factors(process_exec(), *dev_keys, 4.0, f.sharing, *dqf, *dkf);
    EXPECT_TRUE(same_bytes(*to_host(*dqf), *qf)) << static_cast<int>(f.sharing);
    EXPECT_TRUE(same_bytes(*to_host(*dkf), *kf)) << static_cast<int>(f.sharing);
  }
  OwnedTensor factors = test::random_tensor(DType::f32, Shape{3}, 7, 1.0);
  for (const bool offset : {false, true}) {
    for (const Shape shape : {Shape{48, 70}, Shape{48}}) {
      OwnedTensor w = test::random_tensor(DType::f32, shape, 8, 1.0);
      const OwnedTensor dw = to_device(*w);
      ops::scale_head_rows(process_exec(), *w, *factors, 16, offset);
      ops::scale_head_rows(process_exec(), *dw, *to_device(*factors), 16, offset);
      EXPECT_TRUE(same_bytes(*to_host(*dw), *w)) << shape.str() << (offset ? " offset" : "");
    }
  }
}

// The largest logit of one batch's training forward, in a bf16 model built with `tau`;
// with `clip`, a clip after it (no optimizer step between) and the batch's largest again.
std::pair<double, double> bf16_clip(const ModelConfig& c, double tau) {
  BuildOptions o;
  o.dtype = DType::bf16;
  o.device = Device::cuda;
  o.max_tokens = 24;
  o.qk_clip_tau = tau;
  Model m(c, o);
  m.allocate();
  m.init_weights(5);
  m.load_batch(test::pack_docs(test::three_docs(), 4));
  auto largest = [&] {
    double best = -INFINITY;
    for (const auto& [name, value] : m.component_metrics())
      if (name.ends_with(".max_logit")) best = std::max(best, value);
    return best;
  };
  m.zero_grads();
  m.forward_backward(0.05);
  m.after_step(true);
  const double before = largest();
  m.forward_backward(0.05);
  m.after_step(false);
  return {before, largest()};
}

TEST_F(GpuQkClip, ABf16ModelsClippedLargestLogitLandsOnTau) {
  for (const bool qk_norm : {false, true}) {
    ModelConfig c = test::tiny_config(qk_norm, false);
    c.hidden = 64, c.head_dim = 16;  // cuDNN's bf16 attention takes head_dim a multiple of 8
    c.init_std = 1.0;                // logits well away from zero
    const double largest = bf16_clip(c, 1e30).first;
    ASSERT_GT(largest, 0.1) << qk_norm;
    const auto [before, after] = bf16_clip(c, 0.5 * largest);
    std::printf("q/k norm %d: largest logit %.4f, after the clip to %.4f: %.4f\n", qk_norm, before, 0.5 * largest, after);
    EXPECT_NEAR(before, largest, 1e-6 * largest);
    // The scaled masters' bf16 copies and bf16 q/k: within bf16's rounding of each.
    EXPECT_NEAR(after, 0.5 * largest, 0.02 * largest) << qk_norm;
  }
}

}  // namespace
}  // namespace kiln

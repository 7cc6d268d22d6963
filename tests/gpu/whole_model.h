// The whole-model GPU tests (a component's GPU model against the CPU's with the same
// weights): their input, a packed batch of byte-level documents; the build options both
// models share; and what each model's run gives to compare.
#pragma once

#include "core/rng.h"
#include "gpu/gpu_harness.h"
#include "data/batch.h"
#include "model/model.h"

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

namespace kiln::gpu_test {

// Documents of `lengths` tokens (BOS 256, then random bytes from `seed`; each token's
// target the next, the last one's EOS 257), then a PAD (258) tail of `pad` tokens
// without targets, packed into one batch.
inline HostBatch packed_documents(std::initializer_list<int64_t> lengths, int64_t pad, uint64_t seed) {
  constexpr int32_t kBos = 256, kEos = 257, kPad = 258;
  Rng rng(seed);
  HostBatch b;
  b.cu_seqlens.push_back(0);
  auto add = [&](int64_t length, bool padding) {
    const size_t first = b.tokens.size();
    for (int64_t i = 0; i < length; ++i) {
      b.tokens.push_back(padding ? kPad : i == 0 ? kBos : static_cast<int32_t>(rng.below(256)));
      b.positions.push_back(static_cast<int32_t>(i));
      if (!padding) ++b.document_tokens;
    }
    for (int64_t i = 0; i < length; ++i) {
      const int32_t target =
          padding ? kIgnoreTarget : i + 1 < length ? b.tokens[first + static_cast<size_t>(i) + 1] : kEos;
      b.targets.push_back(target);
      if (target != kIgnoreTarget) ++b.target_count;
    }
    b.cu_seqlens.push_back(static_cast<int32_t>(b.tokens.size()));
    b.max_seqlen = std::max(b.max_seqlen, static_cast<int32_t>(length));
  };
  for (const int64_t length : lengths) add(length, false);
  add(pad, true);
  return b;
}

// A model of `tokens` rows on `device` in `dtype`, its LM-head loss in chunks of 16 rows
// (so the tests cross chunk boundaries), recomputing `recompute` blocks' activations.
inline BuildOptions options_for(Device device, DType dtype, int64_t tokens, int64_t recompute = 0) {
  BuildOptions o;
  o.device = device;
  o.dtype = dtype;
  o.max_tokens = tokens;
  o.loss_chunk_rows = 16;
  o.recompute_blocks = recompute;
  return o;
}

// Random init with the routers' weights x 30 (logits of a few units: clear choices) and
// sigmoid_bias's bias moved off 0 (so a path that ignores it cannot pass). expert_choice
// ranks tokens, not experts: at x 30 many tokens' probabilities saturate within ulps of 1,
// the CPU's and the GPU's exp order them differently at the capacity's cut (a PAD row's
// logits 0.23 apart on the H200, 2026-12-01), so its router is x 3: spread probabilities.
inline void init_moe_weights(Model& m, uint64_t seed) {
  m.init_weights(seed);
  Rng rng(seed ^ 0xb1a5ull);
  const float router_scale = m.config().moe.router == "expert_choice" ? 3.0f : 30.0f;
  for (const auto& p : m.parameters()) {
    float* v = p->value().data<float>();
    if (p->name().ends_with("mlp.gate.weight"))
      for (int64_t i = 0; i < p->value().numel(); ++i) v[i] *= router_scale;
    if (p->name().ends_with("e_score_correction_bias"))  // sigmoid_bias's balancing bias
      for (int64_t i = 0; i < p->value().numel(); ++i) v[i] = static_cast<float>(0.1 * rng.normal());
  }
}

// The bars of a GPU model against the same model on the CPU in fp32: logits and each
// gradient relative to the floor (floor_fraction of the tensor's largest |value|, see
// gpu_harness.h), the loss relative. fp32 differs from the CPU by summation order only;
// bf16 mixed by its roundings, so its floor is the tensor's max.
struct ModelTolerance {
  double logits, loss, grads, floor_fraction;
};
inline constexpr ModelTolerance kFp32Model{1e-4, 1e-5, 1e-3, kFloorFraction};
inline constexpr ModelTolerance kBf16Model{3e-2, 1e-3, 6e-2, 1.0};

// The same weights (and parameter state, such as a router's bias) in another model of
// the same config, whatever the devices and dtypes.
inline void copy_weights(Model& from, Model& to) {
  ASSERT_EQ(from.parameters().size(), to.parameters().size());
  for (size_t i = 0; i < from.parameters().size(); ++i) {
    ASSERT_EQ(from.parameters()[i]->name(), to.parameters()[i]->name());
    copy_tensor(from.parameters()[i]->value(), to.parameters()[i]->value());
  }
}

// What a model gives to compare: every row's logits, then one forward_backward's mean loss,
// its loss slots and each trainable parameter's gradient (host, the master dtype).
struct ModelRun {
  std::vector<float> logits;
  double loss = 0;
  LossSlotSums slots{};
  std::vector<std::string> names;
  std::vector<OwnedTensor> grads;
};

inline ModelRun run_model(Model& m, const HostBatch& batch) {
  ModelRun r;
  m.load_batch(batch);
  m.logits(0, batch.size(), r.logits);
  m.zero_grads();
  const LossSums sums = m.forward_backward(1.0 / static_cast<double>(batch.target_count));
  r.loss = sums.loss / static_cast<double>(sums.count);
  r.slots = sums.slot;
  for (const auto& p : m.parameters()) {
    if (!p->trainable()) continue;
    r.names.push_back(p->name());
    r.grads.push_back(to_host(p->grad()));
  }
  return r;
}

// The GPU run's logits [rows, vocab] against the CPU run's (gpu_harness.h's expect_close:
// `tolerance` relative to the floor); the worst error.
inline double expect_logits_close(const ModelRun& want, const ModelRun& got, int64_t vocab, double tolerance,
                                  double floor_fraction) {
  const Shape shape{static_cast<int64_t>(want.logits.size()) / vocab, vocab};
  const OwnedTensor want64 = to_f64(Tensor(const_cast<float*>(want.logits.data()), DType::f32, Device::cpu, shape));
  return expect_close("logits", Tensor(const_cast<float*>(got.logits.data()), DType::f32, Device::cpu, shape),
                      *want64, tolerance, 0, floor_fraction);
}

}  // namespace kiln::gpu_test

// QK-Clip of one attention layer ([optim.qk_clip]; the rule and its grouped-query and
// q/k-norm forms are in ops/attention/qk_clip.h). A token mixer with query-key logits owns
// one (TokenMixer::clips_qk: gqa's); the others have nothing to clip and ignore the key,
// and a model none of whose layers clip is refused when built (model/backbone.cpp). Training forwards raise the step's
// per-head maximum logits (ops/attention/max_logit.h, once per micro-batch: a recomputed
// forward is not measured again); after an applied update the heads over tau have their
// query and key weights (the fp32 masters, with their biases) or, under q/k norms, the
// norms' gains scaled. Nothing is read back but for the log: on the GPU the measure runs
// inside the captured step and the clip right after it on the same stream.
#pragma once

#include "nn/parameter.h"
#include "ops/attention/attention.h"
#include "ops/attention/qk_clip.h"

#include <string>
#include <utility>
#include <vector>

namespace kiln {

// What QK-Clip scales in one layer.
struct QkClipWeights {
  const Tensor* qkv_master = nullptr;  // [(Hq + 2 Hkv) D, hidden] fp32: q rows, then k rows, then v rows
  const Tensor* qkv_bias = nullptr;    // [(Hq + 2 Hkv) D] fp32, or null
  // The key rows in a weight of their own ([Hkv D, cols] first, as MLA's k_b_proj): then
  // qkv_master holds only the q rows and this the k rows.
  const Tensor* k_master = nullptr;
  // Under q/k norms: the tensors that set each side's scale ([D] gains; DyT's gain and
  // bias), and whether a gain is stored as w of 1 + w (Gemma's norm).
  std::vector<const Tensor*> q_gains, k_gains;
  bool gain_offset = false;
};

class QkClip {
 public:
  QkClip(BuildContext& ctx, int64_t layer, int64_t q_heads, int64_t kv_heads, int64_t head_dim, bool qk_norm);

  void set_weights(QkClipWeights weights) { weights_ = std::move(weights); }
  // A training forward's q [T, Hq, D] and k [T, Hkv, D], as attention reads them.
  void measure(const Tensor& q, const Tensor& k, const Tensor& cu_seqlens, const ops::AttentionOptions& options);
  // After each step: the clip when the update was applied; then the step's maxima become
  // the last step's (for report) and the next step starts from none.
  void after_step(bool applied);
  // attn.<layer>.max_logit (the last step's largest over heads) and attn.<layer>.clipped
  // (heads over tau). A synchronizing read on the GPU: log steps only.
  void report(std::vector<std::pair<std::string, double>>& out) const;

 private:
  const ExecContext& exec_;
  int64_t layer_, hq_, hkv_, d_;
  double tau_;
  ops::QkClipSharing sharing_;
  QkClipWeights weights_;
  Tensor step_keys_, last_keys_;  // i32 [Hq] logit keys
  Tensor q_factors_, k_factors_;  // f32 [Hq] and [Hkv], or [1] each with shared gains
};

}  // namespace kiln

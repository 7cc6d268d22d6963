#include "nn/qk_clip.h"

#include "ops/attention/max_logit.h"

#include <algorithm>
#include <cmath>

namespace kiln {

QkClip::QkClip(BuildContext& ctx, int64_t layer, int64_t q_heads, int64_t kv_heads, int64_t head_dim, bool qk_norm)
    : exec_(ctx.exec), layer_(layer), hq_(q_heads), hkv_(kv_heads), d_(head_dim), tau_(ctx.qk_clip_tau) {
  sharing_ = qk_norm            ? ops::QkClipSharing::shared_gains
             : kv_heads < q_heads ? ops::QkClipSharing::shared_keys
                                  : ops::QkClipSharing::per_head;
  const bool shared = sharing_ == ops::QkClipSharing::shared_gains;
  ctx.step_statistic(step_keys_, Shape{hq_}, DType::i32, StepReduction::max_unsigned);
  ctx.step_buffer(last_keys_, Shape{hq_}, DType::i32);
  ctx.step_buffer(q_factors_, Shape{shared ? 1 : hq_}, DType::f32);
  ctx.step_buffer(k_factors_, Shape{shared ? 1 : hkv_}, DType::f32);
}

void QkClip::measure(const Tensor& q, const Tensor& k, const Tensor& cu_seqlens, const ops::AttentionOptions& options) {
  ops::attention_max_logits(exec_, q, k, cu_seqlens, options, step_keys_);
}

void QkClip::after_step(bool applied) {
  if (applied) {
    ops::qk_clip_factors(exec_, step_keys_, tau_, sharing_, q_factors_, k_factors_);
    if (sharing_ == ops::QkClipSharing::shared_gains) {
      // One factor for each side's whole gain (a "head" of its full length).
      for (const Tensor* gain : weights_.q_gains)
        ops::scale_head_rows(exec_, *gain, q_factors_, gain->size(0), weights_.gain_offset);
      for (const Tensor* gain : weights_.k_gains)
        ops::scale_head_rows(exec_, *gain, k_factors_, gain->size(0), weights_.gain_offset);
    } else {
      // The fused projection's q rows, then its k rows (left alone when key heads are shared).
      const bool keys = sharing_ == ops::QkClipSharing::per_head;
      const int64_t q_rows = hq_ * d_, k_rows = hkv_ * d_;
      const Tensor* k_own = weights_.k_master;
      for (const Tensor* w : {weights_.qkv_master, weights_.qkv_bias}) {
        if (w == nullptr || !w->defined()) continue;
        ops::scale_head_rows(exec_, w->rows(0, q_rows), q_factors_, d_);
        if (keys && k_own == nullptr) ops::scale_head_rows(exec_, w->rows(q_rows, q_rows + k_rows), k_factors_, d_);
      }
      if (keys && k_own != nullptr) ops::scale_head_rows(exec_, k_own->rows(0, k_rows), k_factors_, d_);
    }
  }
  ops::take_max_logits(exec_, step_keys_, last_keys_);
}

void QkClip::report(std::vector<std::pair<std::string, double>>& out) const {
  const std::vector<float> max = ops::read_max_logits(exec_, last_keys_);
  float largest = -INFINITY;
  int64_t clipped = 0;
  for (const float m : max) {
    largest = std::max(largest, m);
    if (m > tau_) ++clipped;
  }
  if (!std::isfinite(largest)) return;  // no training forward yet
  const std::string prefix = "attn." + std::to_string(layer_) + ".";
  out.insert(out.end(), {{prefix + "max_logit", largest}, {prefix + "clipped", static_cast<double>(clipped)}});
}

}  // namespace kiln

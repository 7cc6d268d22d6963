// QK-Clip (MuonClip, Kimi K2 / Moonlight): after an optimizer step, the query and key
// weights of every head whose largest attention logit of the step (ops/attention/max_logit.h)
// exceeded tau are scaled so that logit would have been tau: gamma_h = tau / max_h (1 where
// max_h <= tau), the head's q.k scaled by gamma_h. How gamma_h is split between q and k
// depends on what the heads share:
//   per_head      every query head has its own key head (Hkv = Hq): q and k rows of head h
//                 each times sqrt(gamma_h);
//   shared_keys   grouped-query attention (Hkv < Hq): a key head serves several query heads,
//                 so it is left alone and query head h takes the whole gamma_h (Kimi K2's rule
//                 for its shared rotary key);
//   shared_gains  q/k norms (their gains shared by every head decide the logits' scale): the
//                 gains each times sqrt(min_h gamma_h), the most-exceeding head's factor.
// Every op reads and writes device memory on the GPU: no host synchronization.
#pragma once

#include "core/exec_context.h"
#include "core/tensor.h"

namespace kiln::ops {

enum class QkClipSharing { per_head, shared_keys, shared_gains };

// From the step's maxima (i32 [Hq] logit keys; an empty key clips nothing): the factors of
// the query rows (f32 [Hq], or [1] with shared_gains) and of the key rows (f32 [Hkv], or [1]
// with shared_gains; all 1 with shared_keys).
void qk_clip_factors(const ExecContext& ctx, const Tensor& max_logit_keys, double tau, QkClipSharing sharing, const Tensor& q_factors,
                     const Tensor& k_factors);

// The rows of head h of `weight` (a master: fp32 on the GPU, or a bf16 master rounded to
// nearest; 2-D [heads x head_dim, cols] or 1-D [heads x head_dim])
// times factors[h] (f32 [heads]; a single factor scales every row). gain_offset: `weight`
// holds w of a gain 1 + w (Gemma's norm), and the gain is what is scaled: w = (1 + w) f - 1.
void scale_head_rows(const ExecContext& ctx, const Tensor& weight, const Tensor& factors, int64_t head_dim, bool gain_offset = false);

}  // namespace kiln::ops

// The largest attention logit of each query head over a packed batch (QK-Clip's measure,
// nn/qk_clip.h): max over the pairs (i, j) that attention lets query i see (its own
// sequence, j <= i, inside the window) of scale * q_i . k_j, before any softcap, computed
// without materializing the scores. Maxima are kept as logit keys (ops/attention/logit_key.h)
// in an i32 [Hq] tensor: a zero-filled one holds none yet, and each call raises it, so one
// tensor collects a whole step's micro-batches.
#pragma once

#include "core/exec_context.h"
#include "core/tensor.h"
#include "ops/attention/attention.h"

#include <vector>

namespace kiln::ops {

// running [Hq] (i32 keys) = max(running, this batch's maxima). q [N, Hq, D], k [N, Hkv, D]
// as attention_forward takes them; options' scale and window apply, its softcap does not.
void attention_max_logits(const ExecContext& ctx, const Tensor& q, const Tensor& k, const Tensor& cu_seqlens, const AttentionOptions& options,
                          const Tensor& running);

// last = running, then running = none (zeros): the end of a step's collection.
void take_max_logits(const ExecContext& ctx, const Tensor& running, const Tensor& last);

// The maxima as floats (-inf where a head saw no pair). On the GPU, a synchronizing read.
std::vector<float> read_max_logits(const ExecContext& ctx, const Tensor& running);

}  // namespace kiln::ops

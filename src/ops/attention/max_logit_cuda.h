// CUDA kernels behind ops/attention/max_logit.h (max_logit_cuda.cu): the bf16 path on
// tensor cores (WMMA, head_dim a multiple of 16 up to 256), a plain kernel for fp32 and
// other head sizes. They launch on the context's stream and trust the front end.
#pragma once

#include "ops/attention/attention_cuda.h"
#include "ops/mixed_precision.h"

#include <cstdint>

namespace kiln::cuda {

// running [q_heads] (logit keys) = max(running, the batch's per-head maxima); a.softcap unused.
void attention_max_logits_bf16(const ExecContext& ctx, const AttentionArgs& a, const bf16_bits* q, const bf16_bits* k, uint32_t* running);
void attention_max_logits_f32(const ExecContext& ctx, const AttentionArgs& a, const float* q, const float* k, uint32_t* running);
// last [n] = running [n], running = 0.
void take_max_logits(const ExecContext& ctx, uint32_t* running, int64_t n, uint32_t* last);

}  // namespace kiln::cuda

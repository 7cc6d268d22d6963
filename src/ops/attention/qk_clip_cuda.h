// CUDA kernels behind ops/attention/qk_clip.h (qk_clip_cuda.cu). They launch on
// the context's stream and trust the front end.
#pragma once

#include "core/exec_context.h"

#include <cstdint>

namespace kiln::cuda {

// sharing: 0 per_head, 1 shared_keys, 2 shared_gains (ops::QkClipSharing's order).
void qk_clip_factors(const ExecContext& ctx, const uint32_t* keys, int64_t q_heads, int64_t kv_heads, float tau, int sharing,
                     float* q_factors, float* k_factors);
// weight [rows, cols] (cols 1 for a 1-D weight), row r times factors[r / head_dim], or
// factors[0] when `single`.
void scale_head_rows(const ExecContext& ctx, float* weight, int64_t rows, int64_t cols, const float* factors, int64_t head_dim, bool single,
                     bool gain_offset);
// The same on a bf16 master (optim.master_weights; its bit patterns, 2-D, no gain offset):
// each product in fp32, rounded to nearest even (adamw_lowmem::to_bf16, the CPU's bits).
void scale_head_rows_bf16(const ExecContext& ctx, uint16_t* weight, int64_t rows, int64_t cols, const float* factors,
                          int64_t head_dim, bool single);

}  // namespace kiln::cuda

// CUDA kernels behind ops/split/qkv_split.h: fused [n, q_cols + 2 kv_cols] rows to q
// [n, q_cols], k and v [n, kv_cols] (to_parts) or back, as bit-exact copies; fp32 or bf16.
#pragma once

#include "core/exec_context.h"

#include "ops/mixed_precision.h"

#include <cstdint>

namespace kiln::cuda {

void qkv_shuffle_f32(const ExecContext& ctx, float* fused, float* q, float* k, float* v, int64_t n, int64_t q_cols, int64_t kv_cols,
                     bool to_parts);
void qkv_shuffle_bf16(const ExecContext& ctx, bf16_bits* fused, bf16_bits* q, bf16_bits* k, bf16_bits* v, int64_t n, int64_t q_cols,
                      int64_t kv_cols, bool to_parts);

}  // namespace kiln::cuda

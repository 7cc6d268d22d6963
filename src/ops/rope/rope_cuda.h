// CUDA kernels behind ops/rope/rope.h: x [n, heads, 2 * half] rotated in place by
// rotate_half (pairs j, j + half) with fp32 tables [positions, half]; inverse applies the
// transposed rotation. fp32 data, or bf16 data on the mixed path (ops/mixed_precision.h).
#pragma once

#include "core/exec_context.h"

#include "ops/mixed_precision.h"

#include <cstdint>

namespace kiln::cuda {

void rope_apply_f32(const ExecContext& ctx, float* x, const int32_t* positions, const float* cos, const float* sin, int64_t n, int64_t heads,
                    int64_t half, bool inverse);
void rope_apply_bf16(const ExecContext& ctx, bf16_bits* x, const int32_t* positions, const float* cos, const float* sin, int64_t n,
                     int64_t heads, int64_t half, bool inverse);

}  // namespace kiln::cuda

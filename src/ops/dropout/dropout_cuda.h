// The CUDA kernel behind ops/dropout/dropout.h: fp32 or bf16 data (fp32 arithmetic), the
// stream key read from device memory (two words), so a captured step replays with new keys.
#pragma once

#include "core/exec_context.h"

#include "ops/mixed_precision.h"

#include <cstdint>

namespace kiln::cuda {

void dropout_apply_f32(const ExecContext& ctx, const float* x, int64_t n, const int32_t* key, uint32_t site, uint32_t threshold, float scale,
                       float* y);
void dropout_apply_bf16(const ExecContext& ctx, const bf16_bits* x, int64_t n, const int32_t* key, uint32_t site, uint32_t threshold,
                        float scale, bf16_bits* y);

}  // namespace kiln::cuda

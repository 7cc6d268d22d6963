// CUDA kernel behind ops/mla/mla_heads.h (mla_heads_cuda.cu): copy_heads on the device.
// Elements are moved as bits (2 bytes for bf16, 4 for f32): a pad, crop or copy converts
// nothing. Only enqueues on the context's stream (capturable in a CUDA graph).
#pragma once

#include "core/exec_context.h"

#include <cstdint>

namespace kiln::cuda {

// src [rows, a] -> dst [rows, b] of elements `element_bytes` wide (2 or 4): the first
// min(a, b) columns of each row, the rest zero.
void mla_copy_heads(const ExecContext& ctx, int64_t element_bytes, const void* src, int64_t rows, int64_t a,
                    int64_t b, void* dst);

}  // namespace kiln::cuda

// CUTLASS's Hopper grouped GEMM for the experts (grouped_gemm_sm90.cu), used by
// grouped_gemm_cuda.cu for bf16 operands whose widths are multiples of 8 and whose bases
// are 16-byte aligned (TMA's requirements). Row-major operands as kiln keeps them; fp32
// accumulation; the products and their roles as grouped_gemm_cuda.h.
//
// Per call a one-block kernel writes each expert's problem size and operand addresses from
// the device offsets into arrays the kernel reads (an expert without rows: an empty
// problem), then the persistent, warp-specialized TMA + WGMMA kernel runs every expert's
// tiles. No split-K or stream-K: each output tile is one block's sum in K order, so the
// bits do not depend on which block takes it. The arrays, the kernel's parameters and its
// workspace are made once per (product, experts, widths) on first use (outside graph
// capture: the warm-up step) and reused, so later calls only launch.
#pragma once

#include "core/exec_context.h"
#include "ops/mixed_precision.h"

#include <cstdint>

namespace kiln::cuda::sm90 {

// Built with CUTLASS for sm_90a and running on a compute capability 9.0 GPU.
bool grouped_gemm_available();

void grouped_forward(const ExecContext& ctx, const bf16_bits* x, const bf16_bits* w, const int32_t* offsets, int64_t experts, int64_t in,
                     int64_t out, bf16_bits* y);
void grouped_backward_input(const ExecContext& ctx, const bf16_bits* dy, const bf16_bits* w, const int32_t* offsets, int64_t experts,
                            int64_t in, int64_t out, bf16_bits* dx);
void grouped_backward_weight(const ExecContext& ctx, const bf16_bits* x, const bf16_bits* dy, const int32_t* offsets, int64_t experts,
                             int64_t in, int64_t out, float* dw);

}  // namespace kiln::cuda::sm90

// CUTLASS's Hopper grouped GEMM for the experts in tensorwise FP8 (train.fp8_experts;
// grouped_gemm_fp8_sm90.cu, called by grouped_gemm_fp8_cuda.cu). Hopper's FP8 WGMMA reads
// both operands K-major, so every operand here is a row-major [rows, K] matrix of 1-byte
// codes; each expert's product is scaled by its own alpha = scale_inv(A) * scale_inv(B_e),
// written on the device (no host sync: graph-safe), fp32 accumulation with CUTLASS's
// promotion to fp32 registers every 4 MMAs (128 k; no fast accumulation).
//
//   forward      A = Q4(x) [rows, in] (expert e: its rows),  B = Q4(W_e) [out, in],
//                D = y_e bf16 [rows, out]
//   input grad   A = Q5(dy) [rows, out],                     B = Q4(W_e)^T [in, out],
//                D = dx_e bf16 [rows, in]
//   weight grad  A = Q5(dy)^T [out, ld], B = Q4(x)^T [in, ld] (expert e: the ld columns
//                [padded[e], padded[e] + n_e), padded[e] a multiple of 16 so that every
//                expert's TMA base is 16-byte aligned), C = D = dW_e f32, beta 1
//
// As grouped_gemm_sm90.h: a one-block kernel writes each expert's problem, addresses and
// alpha from the device offsets (an expert without rows: an empty problem, so dW_e stays
// as it was), the plans are made once per (product, stream, experts, widths) on first use,
// outside graph capture, and each output tile is one block's sum in K order (same bits
// every run).
#pragma once

#include "core/exec_context.h"
#include "ops/mixed_precision.h"

#include <cstdint>

namespace kiln::cuda::sm90 {

// Built with CUTLASS for sm_90a and running on a compute capability 9.0 GPU.
bool grouped_gemm_fp8_available();

// x_codes e4m3 [rows, in], w_codes e4m3 [E out, in]; x_scale_inv one float, w_scale_inv [E].
void grouped_fp8_forward(const ExecContext& ctx, const uint8_t* x_codes, const float* x_scale_inv, const uint8_t* w_codes,
                         const float* w_scale_inv, const int32_t* offsets, int64_t experts, int64_t in, int64_t out,
                         bf16_bits* y);
// dy_codes e5m2 [rows, out], wt_codes e4m3 [E in, out] (each expert's W_e^T).
void grouped_fp8_backward_input(const ExecContext& ctx, const uint8_t* dy_codes, const float* dy_scale_inv,
                                const uint8_t* wt_codes, const float* w_scale_inv, const int32_t* offsets,
                                int64_t experts, int64_t in, int64_t out, bf16_bits* dx);
// dyt_codes e5m2 [out, ld], xt_codes e4m3 [in, ld]; padded [E + 1] device column offsets.
void grouped_fp8_backward_weight(const ExecContext& ctx, const uint8_t* xt_codes, const float* x_scale_inv,
                                 const uint8_t* dyt_codes, const float* dy_scale_inv, const int32_t* offsets,
                                 const int32_t* padded, int64_t ld, int64_t experts, int64_t in, int64_t out, float* dw);

}  // namespace kiln::cuda::sm90

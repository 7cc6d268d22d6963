// The experts' grouped products on the GPU (behind ops/moe/moe.h's grouped linear): one
// launch over all experts, expert e owning the grouped rows [offsets[e], offsets[e + 1])
// with offsets in device memory, so nothing waits for the host and a step with experts
// can be captured as a CUDA graph. Experts without rows and an expert with all of them
// are ordinary cases.
//
// Two implementations, chosen per call from what the host knows (dtype, widths, alignment,
// the device), never from the row counts:
//   - on Hopper (sm_90a builds with CUTLASS), bf16 operands with widths that are multiples
//     of 8 and 16-byte aligned bases: CUTLASS's grouped GEMM (grouped_gemm_sm90.h), whose
//     problem sizes and operand addresses a small kernel writes from the offsets;
//   - otherwise (f32, odd widths, other GPUs): a tiled grouped GEMM of our own with fp32
//     FMAs (grouped_gemm_cuda.cu), also the f32 path checked against the CPU reference.
// Both are deterministic: each output element is one thread block's sum over K in a fixed
// order (no split-K, no atomics), so a call gives the same bits every run.
#pragma once

#include "core/dtype.h"
#include "core/exec_context.h"

#include <cstdint>
#include <initializer_list>

namespace kiln::cuda {

// x [rows, in], w [E out, in] (expert e's rows [e out, (e + 1) out)) -> y [rows, out] (=):
// y_e = x_e W_e^T. x, w, y of dtype (f32 or bf16).
void grouped_linear_forward(const ExecContext& ctx, const void* x, const void* w, DType dtype, const int32_t* offsets, int64_t experts,
                            int64_t rows, int64_t in, int64_t out, void* y);
// dx [rows, in] (=) = dy_e W_e per expert.
void grouped_linear_backward_input(const ExecContext& ctx, const void* dy, const void* w, DType dtype, const int32_t* offsets,
                                   int64_t experts, int64_t rows, int64_t in, int64_t out, void* dx);
// dw [E out, in] (fp32, +=): dW_e += dy_e^T x_e, a sum over the expert's rows (none: unchanged).
void grouped_linear_backward_weight(const ExecContext& ctx, const void* x, const void* dy, DType dtype, const int32_t* offsets,
                                    int64_t experts, int64_t rows, int64_t in, int64_t out, float* dw);

// Whether a call of this dtype, these widths and these operand bases takes CUTLASS's kernel.
bool grouped_gemm_uses_cutlass(DType dtype, int64_t in, int64_t out, std::initializer_list<const void*> bases);
// Tests and benchmarks: false sends every call to the portable kernel (default true).
void set_grouped_gemm_cutlass(bool enabled);

}  // namespace kiln::cuda

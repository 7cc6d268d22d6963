// CUDA kernels behind ops/short_conv/short_conv.h and ops/kda/kda_mixer_ops.h
// (kda_mixer_cuda.cu): the KDA mixer's per-token pieces around the delta rule.
//
// Activations (x, y, q, k, v, o, gate and their gradients) are f32 or bf16 (`dtype`: bf16
// read, fp32 math, results stored in dtype). The convolution's weight is of dtype too (the
// compute copy on the mixed path); its gradient, the norm gain and its gradient are fp32.
// cu_seqlens i32 [S+1] on the device, trusted. Parameter gradients accumulate (+=) through
// per-block partial sums in the context's scratch added in a fixed order: the same bits
// every run, no atomics, no host synchronization.
#pragma once

#include "core/dtype.h"
#include "core/exec_context.h"

#include <cstdint>

namespace kiln::cuda {

inline constexpr int64_t kShortConvMaxKernel = 8;  // taps kept in registers by the backward

// x, y [n, ch] of dtype, w [ch, kernel] of dtype.
void short_conv_forward(const ExecContext& ctx, DType dtype, const void* x, const void* w, const int32_t* cu_seqlens,
                        int64_t seqs, int64_t n, int64_t ch, int64_t kernel, void* y);
// dx (=) of dtype; dw [ch, kernel] fp32 (+=, null: skipped).
void short_conv_backward(const ExecContext& ctx, DType dtype, const void* x, const void* w,
                         const int32_t* cu_seqlens, int64_t seqs, int64_t n, int64_t ch, int64_t kernel,
                         const void* dy, void* dx, float* dw);

// qkv [n, H (2 dk + dv)] <-> q, k [n, H, dk], v [n, H, dv].
void kda_split_norm_forward(const ExecContext& ctx, DType dtype, const void* qkv, int64_t n, int64_t heads,
                            int64_t dk, int64_t dv, float eps, void* q, void* k, void* v);
void kda_split_norm_backward(const ExecContext& ctx, DType dtype, const void* qkv, const void* dq, const void* dk_,
                             const void* dv_, int64_t n, int64_t heads, int64_t dk, int64_t dv, float eps, void* dqkv);

void kda_beta_forward(const ExecContext& ctx, DType dtype, const void* raw, int64_t count, void* beta);
void kda_beta_backward(const ExecContext& ctx, DType dtype, const void* raw, const void* dbeta, int64_t count,
                       void* draw);

// o, gate, y [rows, d] of dtype (rows = tokens x heads), gain [d] fp32. d <= 1024.
void kda_output_gate_forward(const ExecContext& ctx, DType dtype, const void* o, const float* gain, const void* gate,
                             int64_t rows, int64_t d, float eps, void* y);
// d_o, dgate (=) of dtype; dgain fp32 (+=).
void kda_output_gate_backward(const ExecContext& ctx, DType dtype, const void* o, const float* gain,
                              const void* gate, const void* dy, int64_t rows, int64_t d, float eps, void* d_o,
                              void* dgate, float* dgain);

}  // namespace kiln::cuda

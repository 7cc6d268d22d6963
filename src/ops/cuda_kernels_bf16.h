// bf16 CUDA kernels of the mixed-precision GPU path. The layout of that path:
//   - the residual stream (block inputs/outputs) and its gradient stay fp32, as under
//     PyTorch autocast (embedding output fp32, fp32 + bf16 -> fp32 adds);
//   - everything a GEMM or attention reads is bf16: norm outputs, q/k/v/o, the MLP's
//     gate|up and hidden, and the compute copies of rank-2 weights;
//   - norm gains, RoPE tables, softmax statistics and every parameter gradient are fp32;
//   - all arithmetic inside a kernel is fp32; only loads and stores are bf16.
// bf16 values cross this header as their 16 bits (`bf16_bits`, the layout of
// __nv_bfloat16), so host code includes it without CUDA headers. The front ends validate
// shapes and dtypes; these launch on kiln::cuda::stream() and trust their inputs.
// Reductions (norm gain gradients, loss rows) use fixed orders: results are bitwise
// reproducible run to run.
#pragma once

#include "core/dtype.h"
#include "ops/cuda_kernels.h"

#include <cstdint>

namespace kiln::cuda {

using bf16_bits = uint16_t;

// dst = bf16(src), round to nearest even (weights' compute copies, fp32 -> bf16 grads).
void cast_f32_to_bf16(const float* src, int64_t n, bf16_bits* dst);
void cast_bf16_to_f32(const bf16_bits* src, int64_t n, float* dst);

// RMSNorm with an fp32 gain: y = x * rstd * w, rstd = 1/sqrt(mean(x^2) + eps) (fp32, [rows]).
// x is fp32 (residual stream) or bf16; y is bf16. With b (bf16, a branch output; fp32 x
// only) the input is x + b, also written to sum (fp32): the residual add fused in. No
// output may alias an input.
void rms_norm_forward_mixed(const void* x, DType x_dtype, const float* w, float eps, int64_t rows, int64_t cols,
                            bf16_bits* y, float* rstd, const bf16_bits* b = nullptr, float* sum = nullptr);
// dy bf16; dx has x's dtype and is written (=) or accumulated (+=, the fp32 residual
// gradient); dw (fp32, [cols]) is accumulated (+=) in a fixed order; dx_copy (null: none)
// receives dx's final values in bf16.
void rms_norm_backward_mixed(const void* x, DType x_dtype, const float* w, const float* rstd, const bf16_bits* dy,
                             int64_t rows, int64_t cols, void* dx, bool accumulate_dx, float* dw,
                             bf16_bits* dx_copy);

// out = a + b with a fp32 (residual), b bf16 (branch output), out fp32 (may alias a).
void add_f32_bf16(const float* a, const bf16_bits* b, int64_t n, float* out);

// As the fp32 kernels of cuda_kernels.h, on bf16 data (tables and statistics fp32).
void rope_apply_bf16(bf16_bits* x, const int32_t* positions, const float* cos, const float* sin, int64_t n,
                     int64_t heads, int64_t half, bool inverse);
void qkv_shuffle_bf16(bf16_bits* fused, bf16_bits* q, bf16_bits* k, bf16_bits* v, int64_t n, int64_t q_cols,
                      int64_t kv_cols, bool to_parts);
void swiglu_forward_bf16(const bf16_bits* gate_up, int64_t n, int64_t f, bf16_bits* out);
void swiglu_backward_bf16(const bf16_bits* gate_up, const bf16_bits* dout, int64_t n, int64_t f,
                          bf16_bits* dgate_up, bf16_bits* out);

// Cross-entropy rows of an fp32 logits chunk [rows, vocab] (the LM head GEMM writes fp32
// logits from bf16 operands). With grad, grad_out [rows, vocab] (bf16) receives
// loss_scale * d(objective)/dlogits (zero rows for ignored targets), ready for the two
// backward GEMMs; logits are left as they were. row_stats as cross_entropy_rows_f32.
void cross_entropy_rows_to_bf16(const float* logits, const int32_t* targets, int64_t rows, int64_t vocab,
                                float z_loss, LossScale loss_scale, float softcap, bool grad, double* row_stats,
                                bf16_bits* grad_out);

// The same on a bf16 logits chunk, in place: with grad, each row of `logits` becomes its
// bf16 gradient (the LM head's mixed path keeps logits in bf16, as autocast does).
void cross_entropy_rows_bf16(bf16_bits* logits, const int32_t* targets, int64_t rows, int64_t vocab, float z_loss,
                             LossScale loss_scale, float softcap, bool grad, double* row_stats);

}  // namespace kiln::cuda

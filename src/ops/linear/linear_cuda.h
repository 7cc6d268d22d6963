// CUDA kernels behind ops/linear/linear.h (and the GEMMs other ops call): cuBLASLt
// products (gemm_cuda.cu) and the linear layer's bias kernels (linear_cuda.cu). They
// launch on the context's stream and trust their inputs (the front ends validate);
// cuBLASLt's workspace is one per stream.
#pragma once

#include "core/dtype.h"
#include "core/exec_context.h"

#include <cstdint>

namespace kiln::cuda {

// Row-major C [m, n] = alpha op(A) op(B) + beta C through cuBLASLt with fp32 accumulation.
// A and B share ab_dtype (bf16 or f32); C is bf16 or f32 (bf16 operands may write fp32,
// e.g. logits or weight gradients accumulated with beta = 1). f32 x f32 is pedantic fp32.
void gemm(const ExecContext& ctx, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const void* a, int64_t lda,
          const void* b, int64_t ldb, DType ab_dtype, float beta, void* c, int64_t ldc, DType c_dtype);

// The strided-batched form of gemm, for many same-shape products in one launch (Muon's
// Newton-Schulz iteration, ops/optim/muon.h): for i < batch, row-major
//   D_i [m, n] = alpha op(A_i) op(B_i) + beta C_i,
// A_i = a + i stride_a, B_i = b + i stride_b, C_i = c + i stride_c, D_i = d + i stride_c
// (strides in elements; D shares C's leading dimension and stride). d may differ from c
// (out of place: C is read, D written) or equal it; c is read only when beta != 0 (may
// then be null). Same dtypes, accumulation and algorithm discipline as gemm (the
// heuristic's first choice, cached by problem: reproducible bits); no skinny-kernel path.
// Pointers and strides should keep 256-byte alignment (cuBLASLt's assumption).
void gemm_strided_batched(const ExecContext& ctx, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const void* a,
                          int64_t lda, int64_t stride_a, const void* b, int64_t ldb, int64_t stride_b, DType ab_dtype,
                          float beta, const void* c, void* d, int64_t ldc, int64_t stride_c, DType cd_dtype,
                          int64_t batch);

// Row-major C [m, n] = alpha op(A) op(B) + beta C in fp32 (A is [m, k] after op, B [k, n]),
// the same contract as ops::cpu_gemm (cuBLAS, pedantic fp32).
void gemm_f32(const ExecContext& ctx, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
              const float* b, int64_t ldb, float beta, float* c, int64_t ldc);

// linear: y = x w^T (+ bias). x, w, y, dy, dx share `dtype` (f32, or bf16 on the mixed
// path); bias and dbias are fp32; dw (+=) is fp32 or `dtype` (dw_dtype).
void linear_forward(const ExecContext& ctx, const void* x, const void* w, DType dtype, const float* bias, int64_t n, int64_t in,
                    int64_t out, void* y);
// y [n, out] = bias in every row (the start of a product accumulated onto it with beta = 1).
void linear_broadcast_bias(const ExecContext& ctx, const float* bias, DType dtype, int64_t n, int64_t out, void* y);
void linear_backward(const ExecContext& ctx, const void* x, const void* w, const void* dy, DType dtype, int64_t n, int64_t in, int64_t out,
                     void* dx, bool accumulate_dx, void* dw, DType dw_dtype, float* dbias);

}  // namespace kiln::cuda

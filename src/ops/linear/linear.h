// Linear layer y = x W^T (+ b), weights in PyTorch's [out, in] layout.
#pragma once

#include "core/exec_context.h"
#include "core/tensor.h"

namespace kiln::ops {

// x [N, in], w [out, in], bias [out] or undefined -> y [N, out] (written with =).
void linear_forward(const ExecContext& ctx, const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& y);

// dy [N, out]. dx [N, in]: written with = (or += when accumulate_dx); skipped if undefined.
// dw [out, in] and dbias [out]: accumulated with += (skipped if undefined).
void linear_backward(const ExecContext& ctx, const Tensor& x, const Tensor& w, const Tensor& dy, const Tensor& dx, const Tensor& dw,
                     const Tensor& dbias, bool accumulate_dx = false);

// C [M, N] = alpha * op(A) op(B) + beta * C on the CPU, row-major (BLAS underneath).
template <typename T>
void cpu_gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda,
              const T* b, int64_t ldb, T beta, T* c, int64_t ldc);

}  // namespace kiln::ops

// The skinny-product path of cuda::gemm (ops/linear/gemv_cuda.cu): decode steps multiply
// a handful of token rows by whole weight matrices. CUDA translation units only.
#pragma once

#include "core/dtype.h"

#include <cstdint>

namespace kiln::cuda {

// Rows of A up to which the skinny kernel takes the product. Measured on the H200 (0.6B
// decode step, 2026-11-29): one row 1.605 ms per step against 1.863 ms on cuBLASLt, but
// eight rows 2.97 ms against 1.83 ms (each warp re-reads the eight A rows per vector of
// B); so only single-row products take it until the kernel stages A in shared memory.
constexpr int64_t kMaxSkinnyRows = 1;

// Runs C = alpha A B^T + beta C on the skinny kernel and returns true when the problem
// fits it (row-major A [m, k] with m <= kMaxSkinnyRows, B [n, k] not transposed in
// memory, bf16 operands, bf16 or f32 C, 16-byte aligned rows); else returns false.
bool try_skinny_gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const void* a,
                     int64_t lda, const void* b, int64_t ldb, DType ab_dtype, float beta, void* c, int64_t ldc,
                     DType c_dtype);

}  // namespace kiln::cuda

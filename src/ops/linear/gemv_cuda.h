// The skinny-product path of cuda::gemm (ops/linear/gemv_cuda.cu): decode steps multiply
// a handful of token rows by whole weight matrices. CUDA translation units only.
#pragma once

#include "core/dtype.h"
#include "core/exec_context.h"

#include <cstdint>

namespace kiln::cuda {

// Rows of A up to which the skinny kernel takes the product. (The first version, one warp
// per column re-reading A from cache, was measured on the H200 at 1.605 ms per 0.6B decode
// step at one row against 1.863 ms on cuBLASLt, but 2.97 against 1.83 ms at eight rows;
// since its products run on the tensor cores, eight rows cost about what one does: a
// 0.6B decode step at batch 8 took 1.321 ms on it against 1.597 ms through cuBLASLt.)
constexpr int64_t kMaxSkinnyRows = 8;

// Runs C = alpha A B^T + beta C on the skinny kernel and returns true when the problem
// fits it (row-major A [m, k] with m <= kMaxSkinnyRows, B [n, k] not transposed in
// memory, bf16 operands, bf16 or f32 C, 16-byte aligned rows, A small enough to stage); else returns false.
bool try_skinny_gemm(const ExecContext& ctx, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const void* a,
                     int64_t lda, const void* b, int64_t ldb, DType ab_dtype, float beta, void* c, int64_t ldc,
                     DType c_dtype);

}  // namespace kiln::cuda

// Skinny bf16 products for decoding through the kernel of ops/linear/gemv_kernel.cuh: C [m, n]
// = alpha A [m, k] B^T + beta C with m up to kMaxSkinnyRows rows (the tokens of a decode
// step) and B [n, k] row-major (a weight). cuBLASLt's kernels for m = 1..8 were measured at
// ~14 us per decode GEMM on the H200, several times the copy time of the weight.
#include "ops/linear/gemv_cuda.h"

#include "ops/linear/gemv_kernel.cuh"

namespace kiln::cuda {

bool try_skinny_gemm(const ExecContext& ctx, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const void* a,
                     int64_t lda, const void* b, int64_t ldb, DType ab_dtype, float beta, void* c, int64_t ldc,
                     DType c_dtype) {
  if (trans_a || !trans_b || ab_dtype != DType::bf16 || m < 1 || m > kMaxSkinnyRows) return false;
  if (c_dtype != DType::bf16 && c_dtype != DType::f32) return false;
  gemv::Args p;
  p.m = m, p.n = n, p.k = k;
  p.a = static_cast<const gemv::bf16*>(a), p.lda = lda;
  p.w = static_cast<const gemv::bf16*>(b), p.ldw = ldb;
  p.out = c, p.ldo = ldc, p.alpha = alpha, p.beta = beta;
  if (!gemv::fits(p, gemv::Input::bf16_rows)) return false;
  if (c_dtype == DType::f32)
    gemv::launch<gemv::Input::bf16_rows, gemv::Output::store, float>(p, stream(ctx));
  else
    gemv::launch<gemv::Input::bf16_rows, gemv::Output::store, gemv::bf16>(p, stream(ctx));
  return true;
}

}  // namespace kiln::cuda

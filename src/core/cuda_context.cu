#include "core/cuda_check.h"
#include "core/cuda_context.h"

#include <map>

namespace kiln::cuda {

cudaStream_t stream() {
  // One created stream for every kernel and library call: CUDA graphs cannot capture the
  // legacy default stream. It is a blocking stream (default flags), so the plain
  // cudaMemcpy/cudaMemset calls of core/device_memory (legacy stream) stay ordered with
  // it both ways, as before.
  static cudaStream_t s = [] {
    cudaStream_t created = nullptr;
    check(cudaStreamCreate(&created), "cuda", "cudaStreamCreate");
    return created;
  }();
  return s;
}

int sm_count() {
  static const int count = [] {
    int device = 0, n = 0;
    check(cudaGetDevice(&device), "cuda", "cudaGetDevice");
    check(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device), "cuda", "cudaDeviceGetAttribute");
    return n;
  }();
  return count;
}

namespace {
cublasHandle_t create_blas(cudaStream_t s) {
  cublasHandle_t h = nullptr;
  if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) fail("cuda", "cublasCreate failed");
  cublasSetStream(h, s);
  // Pedantic fp32: the fp32 path is the one checked against the CPU reference.
  cublasSetMathMode(h, CUBLAS_PEDANTIC_MATH);
  return h;
}
}  // namespace

cublasHandle_t blas() {
  static cublasHandle_t handle = create_blas(stream());
  return handle;
}

cublasHandle_t blas(const ExecContext& ctx) {
  if (!ctx.stream) return blas();
  // Kept for the life of the process, as the process-wide one.
  static std::map<cudaStream_t, cublasHandle_t> handles;
  const auto s = static_cast<cudaStream_t>(ctx.stream);
  if (s == stream()) return blas();
  auto it = handles.find(s);
  if (it == handles.end()) it = handles.emplace(s, create_blas(s)).first;
  return it->second;
}

void gemm_f32(const ExecContext& ctx, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
              const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: swap the operands.
  const cublasStatus_t status =
      cublasSgemm(blas(ctx), trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
                  static_cast<int>(n), static_cast<int>(m), static_cast<int>(k), &alpha, b, static_cast<int>(ldb), a,
                  static_cast<int>(lda), &beta, c, static_cast<int>(ldc));
  if (status != CUBLAS_STATUS_SUCCESS) fail("gemm", "cublasSgemm failed ({})", static_cast<int>(status));
}

}  // namespace kiln::cuda

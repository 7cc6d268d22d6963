// Dtype-generic GEMM on cuBLASLt (the contract is in ops/linear/linear_cuda.h), single or
// strided-batched. Each distinct problem (shape, transposes, dtypes, whether C is read,
// batch count and strides) gets its descriptors and the heuristic's first algorithm once,
// then reuses them: the step loop never asks the heuristic again, and a given problem
// always runs the same algorithm (reproducible bits).
#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "ops/linear/linear_cuda.h"
#include "ops/linear/gemv_cuda.h"

#include <cublasLt.h>

#include <map>
#include <tuple>
#include <utility>

namespace kiln::cuda {

namespace {

// cuBLAS' recommendation for Hopper: 32 MiB lets the heuristic pick split-K and
// stream-K kernels for the skinny shapes (weight gradients).
constexpr size_t kWorkspaceBytes = 32u << 20;

void check_lt(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) fail("gemm", "cuBLASLt {} failed: {}", what, cublasGetStatusString(status));
}

cudaDataType_t cuda_type(DType dtype) {
  switch (dtype) {
    case DType::f32: return CUDA_R_32F;
    case DType::bf16: return CUDA_R_16BF;
    case DType::f16: return CUDA_R_16F;
    default: fail("gemm", "no GEMM on {} operands", dtype_name(dtype));
  }
}

struct LtContext {
  cublasLtHandle_t handle = nullptr;
  LtContext() { check_lt(cublasLtCreate(&handle), "create"); }
  // One workspace per stream (products on two streams must not share one), each allocated
  // once, on the stream's first product (before any graph capture: the model's first
  // forward). Kept for the life of the process.
  void* workspace(cudaStream_t stream) {
    if (last_workspace && stream == last_stream) return last_workspace;
    auto it = workspaces.find(stream);
    if (it == workspaces.end()) {
      void* w = nullptr;
      check(cudaMalloc(&w, kWorkspaceBytes), "gemm", "cudaMalloc workspace");
      it = workspaces.emplace(stream, w).first;
    }
    last_stream = stream, last_workspace = it->second;
    return last_workspace;
  }

 private:
  std::map<cudaStream_t, void*> workspaces;
  cudaStream_t last_stream = nullptr;
  void* last_workspace = nullptr;
};

LtContext& lt() {
  static LtContext context;
  return context;
}

// Column-major view (cuBLAS' native order) of a row-major problem: C^T = op(B)^T op(A)^T,
// so B is the first operand and the roles of m and n swap.
// A batch of 1 (the plain gemm) sets no batch attributes: its descriptors are exactly the
// unbatched ones. Strides are in elements, between consecutive matrices of the batch.
struct Problem {
  bool trans_a, trans_b;
  int64_t m, n, k, lda, ldb, ldc;
  DType ab, c;
  bool reads_c;
  int64_t batch = 1, stride_a = 0, stride_b = 0, stride_c = 0;
  auto key() const {
    return std::tie(trans_a, trans_b, m, n, k, lda, ldb, ldc, ab, c, reads_c, batch, stride_a, stride_b, stride_c);
  }
  bool operator<(const Problem& o) const { return key() < o.key(); }
};

struct Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
};

Plan make_plan(const Problem& p) {
  Plan plan;
  // Pedantic fp32 for f32 x f32 (the path checked against the CPU reference); fp32
  // accumulation of bf16 products otherwise.
  const cublasComputeType_t compute = p.ab == DType::f32 ? CUBLAS_COMPUTE_32F_PEDANTIC : CUBLAS_COMPUTE_32F;
  check_lt(cublasLtMatmulDescCreate(&plan.op, compute, CUDA_R_32F), "matmul descriptor");
  // First operand of the column-major product is B (row-major [k, n] or [n, k] when transposed).
  const cublasOperation_t op_first = p.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_second = p.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  check_lt(cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_TRANSA, &op_first, sizeof(op_first)), "transa");
  check_lt(cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_TRANSB, &op_second, sizeof(op_second)),
           "transb");
  // Column-major shapes as stored: B^T is [n, k] (or [k, n] if trans_b), leading dim ldb.
  const uint64_t b_rows = p.trans_b ? p.k : p.n, b_cols = p.trans_b ? p.n : p.k;
  const uint64_t a_rows = p.trans_a ? p.m : p.k, a_cols = p.trans_a ? p.k : p.m;
  check_lt(cublasLtMatrixLayoutCreate(&plan.a, cuda_type(p.ab), b_rows, b_cols, p.ldb), "layout B");
  check_lt(cublasLtMatrixLayoutCreate(&plan.b, cuda_type(p.ab), a_rows, a_cols, p.lda), "layout A");
  check_lt(cublasLtMatrixLayoutCreate(&plan.c, cuda_type(p.c), p.n, p.m, p.ldc), "layout C");
  if (p.batch > 1) {
    // The same three layouts, repeated batch times at the given strides (D shares C's).
    const int32_t count = static_cast<int32_t>(p.batch);
    const std::pair<cublasLtMatrixLayout_t, int64_t> layouts[] = {
        {plan.a, p.stride_b}, {plan.b, p.stride_a}, {plan.c, p.stride_c}};
    for (auto [layout, stride] : layouts) {
      check_lt(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)),
               "batch count");
      check_lt(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                                                sizeof(stride)),
               "batch stride");
    }
  }

  cublasLtMatmulPreference_t preference = nullptr;
  check_lt(cublasLtMatmulPreferenceCreate(&preference), "preference");
  const size_t workspace = kWorkspaceBytes;
  check_lt(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
                                                sizeof(workspace)),
           "preference workspace");
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  check_lt(cublasLtMatmulAlgoGetHeuristic(lt().handle, plan.op, plan.a, plan.b, plan.c, plan.c, preference, 1,
                                          &result, &found),
           "heuristic");
  cublasLtMatmulPreferenceDestroy(preference);
  if (found == 0)
    fail("gemm", "cuBLASLt has no algorithm for m={} n={} k={} batch={} {} x {} -> {}", p.m, p.n, p.k, p.batch,
         dtype_name(p.ab), dtype_name(p.ab), dtype_name(p.c));
  plan.algo = result.algo;
  return plan;
}

const Plan& plan_for(const Problem& p) {
  static std::map<Problem, Plan> plans;  // descriptors live as long as the process
  auto it = plans.find(p);
  if (it == plans.end()) it = plans.emplace(p, make_plan(p)).first;
  return it->second;
}

}  // namespace

void gemm(const ExecContext& ctx, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const void* a, int64_t lda,
          const void* b, int64_t ldb, DType ab_dtype, float beta, void* c, int64_t ldc, DType c_dtype) {
  if (m == 0 || n == 0) return;
  if (k == 0) fail("gemm", "k = 0 (m={} n={})", m, n);
  if (try_skinny_gemm(ctx, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, ab_dtype, beta, c, ldc, c_dtype)) return;
  const Problem problem{trans_a, trans_b, m, n, k, lda, ldb, ldc, ab_dtype, c_dtype, beta != 0.0f};
  const Plan& plan = plan_for(problem);
  const cudaStream_t s = stream(ctx);
  check_lt(cublasLtMatmul(lt().handle, plan.op, &alpha, b, plan.a, a, plan.b, &beta, c, plan.c, c, plan.c, &plan.algo,
                          lt().workspace(s), kWorkspaceBytes, s),
           "matmul");
}

void gemm_strided_batched(const ExecContext& ctx, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const void* a,
                          int64_t lda, int64_t stride_a, const void* b, int64_t ldb, int64_t stride_b, DType ab_dtype,
                          float beta, const void* c, void* d, int64_t ldc, int64_t stride_c, DType cd_dtype,
                          int64_t batch) {
  if (m == 0 || n == 0 || batch == 0) return;
  if (k == 0) fail("gemm", "k = 0 (m={} n={} batch={})", m, n, batch);
  KILN_CHECK(batch > 0 && batch <= 0x7fffffff, "gemm", "batch count {} out of range", batch);
  if (batch == 1) stride_a = stride_b = stride_c = 0;  // one matrix: the plain problem's plan
  const Problem problem{trans_a, trans_b, m, n, k, lda, ldb, ldc, ab_dtype, cd_dtype, beta != 0.0f,
                        batch, stride_a, stride_b, stride_c};
  const Plan& plan = plan_for(problem);
  const cudaStream_t s = stream(ctx);
  // C is read only with beta != 0; cuBLASLt still wants a pointer, D serves.
  const void* c_in = beta != 0.0f ? c : d;
  check_lt(cublasLtMatmul(lt().handle, plan.op, &alpha, b, plan.a, a, plan.b, &beta, c_in, plan.c, d, plan.c,
                          &plan.algo, lt().workspace(s), kWorkspaceBytes, s),
           "matmul");
}

}  // namespace kiln::cuda

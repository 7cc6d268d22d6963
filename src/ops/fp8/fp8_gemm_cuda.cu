// FP8 GEMM on cuBLASLt (contract in ops/fp8/fp8_gemm_cuda.h). Column-major view of the
// row-major product, as ops/linear/gemm_cuda.cu: C^T [n, m] = B [n, k] A [m, k]^T, so
// cuBLASLt's first operand is B (stored [k, n] column-major, transposed: "T") and its second
// A (stored [k, m], not transposed: "N"): both K-major, the "TN" layout FP8 requires.
#include "ops/fp8/fp8_gemm_cuda.h"

#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "core/error.h"

#include <cublasLt.h>

#include <cstdint>
#include <map>
#include <tuple>
#include <utility>

namespace kiln::cuda {

namespace {

constexpr const char* kOp = "fp8_gemm";
constexpr size_t kWorkspaceBytes = 32u << 20;  // cuBLAS' recommendation for Hopper (as gemm_cuda.cu)
constexpr int64_t kDimMultiple = 16;           // cuBLASLt FP8: every dimension a multiple of 16

void check_lt(cublasStatus_t status, const char* call) {
  if (status != CUBLAS_STATUS_SUCCESS) fail(kOp, "{} failed: {}", call, cublasGetStatusString(status));
}

// The handle and one workspace per stream (products on two streams must not share one),
// each allocated on first use and kept for the life of the process.
struct LtContext {
  cublasLtHandle_t handle = nullptr;
  std::map<cudaStream_t, void*> workspaces;
  LtContext() { check_lt(cublasLtCreate(&handle), "cublasLtCreate"); }
  void* workspace(cudaStream_t stream) {
    auto it = workspaces.find(stream);
    if (it == workspaces.end()) {
      void* w = nullptr;
      check(cudaMalloc(&w, kWorkspaceBytes), kOp, "cudaMalloc workspace");
      it = workspaces.emplace(stream, w).first;
    }
    return it->second;
  }
};

LtContext& lt() {
  static LtContext context;
  return context;
}

bool same(ops::fp8::BlockShape x, ops::fp8::BlockShape y) { return x.rows == y.rows && x.cols == y.cols; }

int32_t scale_mode(ops::fp8::BlockShape block, const char* operand) {
  if (same(block, kFp8Tensorwise)) return CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
  if (same(block, ops::fp8::kActivationTile)) return CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
  if (same(block, ops::fp8::kWeightBlock)) return CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
  fail(kOp, "operand {}: block shape [{}, {}] (tensorwise {{0, 0}}, 1 x 128 or 128 x 128)", operand, block.rows,
       block.cols);
}

cudaDataType_t fp8_type(ops::fp8::Format format) {
  return format == ops::fp8::Format::e4m3 ? CUDA_R_8F_E4M3 : CUDA_R_8F_E5M2;
}

struct Problem {
  int64_t m, n, k;
  ops::fp8::Format a_format, b_format;
  int32_t a_mode, b_mode;
  DType c;
  auto key() const { return std::tie(m, n, k, a_format, b_format, a_mode, b_mode, c); }
  bool operator<(const Problem& o) const { return key() < o.key(); }
};

struct Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t first = nullptr, second = nullptr, out = nullptr;
  cublasLtMatmulAlgo_t algo{};
};

template <typename T>
void set(cublasLtMatmulDesc_t op, cublasLtMatmulDescAttributes_t attribute, const T& value, const char* what) {
  check_lt(cublasLtMatmulDescSetAttribute(op, attribute, &value, sizeof(value)), what);
}

void set_scale_pointers(cublasLtMatmulDesc_t op, const float* a_scale_inv, const float* b_scale_inv) {
  // cuBLASLt's A is our B and its B our A.
  set(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, b_scale_inv, "cublasLtMatmulDescSetAttribute(A_SCALE_POINTER)");
  set(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, a_scale_inv, "cublasLtMatmulDescSetAttribute(B_SCALE_POINTER)");
}

// The first call's scale pointers are on the descriptor before the heuristic runs: with the
// blockwise modes and no pointers set, cuBLASLt 13.1's heuristic found no algorithm at any
// shape (H100, 2026-12-06 and -07), where a probe that set them first found one at every
// shape, 16 x 128 x 128 to 1024 x 2048 x 2048, both mode orders, bf16 and f32 out.
Plan make_plan(const Problem& p, const float* a_scale_inv, const float* b_scale_inv) {
  Plan plan;
  check_lt(cublasLtMatmulDescCreate(&plan.op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
  set(plan.op, CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T, "cublasLtMatmulDescSetAttribute(TRANSA)");
  set(plan.op, CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N, "cublasLtMatmulDescSetAttribute(TRANSB)");
  if (p.a_mode == CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F) {
    // The default, said out loud: promote to fp32 periodically. Left unset for the blockwise
    // modes, which refuse fast accumulation (PyTorch checks the same) and which the probe
    // above found kernels for with the attribute untouched.
    const int8_t fast_accumulation = 0;
    set(plan.op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, fast_accumulation, "cublasLtMatmulDescSetAttribute(FAST_ACCUM)");
  }
  // cuBLASLt's A is our B and its B our A.
  set(plan.op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, p.b_mode, "cublasLtMatmulDescSetAttribute(A_SCALE_MODE)");
  set(plan.op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, p.a_mode, "cublasLtMatmulDescSetAttribute(B_SCALE_MODE)");
  set_scale_pointers(plan.op, a_scale_inv, b_scale_inv);
  check_lt(cublasLtMatrixLayoutCreate(&plan.first, fp8_type(p.b_format), p.k, p.n, p.k),
           "cublasLtMatrixLayoutCreate(B)");
  check_lt(cublasLtMatrixLayoutCreate(&plan.second, fp8_type(p.a_format), p.k, p.m, p.k),
           "cublasLtMatrixLayoutCreate(A)");
  const cudaDataType_t c_type = p.c == DType::f32 ? CUDA_R_32F : CUDA_R_16BF;
  check_lt(cublasLtMatrixLayoutCreate(&plan.out, c_type, p.n, p.m, p.n), "cublasLtMatrixLayoutCreate(C)");

  cublasLtMatmulPreference_t preference = nullptr;
  check_lt(cublasLtMatmulPreferenceCreate(&preference), "cublasLtMatmulPreferenceCreate");
  const size_t workspace = kWorkspaceBytes;
  check_lt(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
                                                sizeof(workspace)),
           "cublasLtMatmulPreferenceSetAttribute(MAX_WORKSPACE_BYTES)");
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(lt().handle, plan.op, plan.first, plan.second, plan.out,
                                                               plan.out, preference, 1, &result, &found);
  check_lt(cublasLtMatmulPreferenceDestroy(preference), "cublasLtMatmulPreferenceDestroy");
  if (status != CUBLAS_STATUS_SUCCESS || found == 0)
    fail(kOp, "cublasLtMatmulAlgoGetHeuristic has no algorithm for m={} n={} k={} A {} (scale mode {}) x B {} "
              "(scale mode {}) -> {}: {}",
         p.m, p.n, p.k, ops::fp8::name(p.a_format), p.a_mode, ops::fp8::name(p.b_format), p.b_mode, dtype_name(p.c),
         status == CUBLAS_STATUS_SUCCESS ? "no result" : cublasGetStatusString(status));
  plan.algo = result.algo;
  return plan;
}

Plan& plan_for(const Problem& p, const float* a_scale_inv, const float* b_scale_inv) {
  static std::map<Problem, Plan> plans;  // descriptors live as long as the process
  auto it = plans.find(p);
  if (it == plans.end()) it = plans.emplace(p, make_plan(p, a_scale_inv, b_scale_inv)).first;
  return it->second;
}

void check_operand(const Fp8Operand& x, const char* name) {
  KILN_CHECK(x.codes != nullptr && x.scale_inv != nullptr, kOp, "operand {}: codes and scale_inv must be set", name);
  KILN_CHECK(reinterpret_cast<uintptr_t>(x.codes) % 16 == 0, kOp, "operand {}: codes must be 16-byte aligned", name);
  // cublasLtMatmul answered "not supported" for a tensorwise scale 4 bytes into an
  // allocation and ran with each scale in an allocation of its own (H100, 2026-12-06;
  // test_gpu_fp8's graph test): said here in one line instead.
  KILN_CHECK(reinterpret_cast<uintptr_t>(x.scale_inv) % 16 == 0, kOp, "operand {}: scale_inv must be 16-byte aligned",
             name);
}

}  // namespace

void fp8_gemm(const ExecContext& ctx, int64_t m, int64_t n, int64_t k, const Fp8Operand& a, const Fp8Operand& b,
              void* c, DType c_dtype, bool accumulate) {
  KILN_CHECK(m > 0 && n > 0 && k > 0, kOp, "m={} n={} k={} must be positive", m, n, k);
  for (auto [dim, value] : {std::pair{"m", m}, std::pair{"n", n}, std::pair{"k", k}})
    KILN_CHECK(value % kDimMultiple == 0, kOp,
               "{}={} is not a multiple of {} (cuBLASLt FP8 needs m, n, k multiples of 16; pad the operands)", dim,
               value, kDimMultiple);
  KILN_CHECK(c_dtype == DType::bf16 || c_dtype == DType::f32, kOp, "output dtype {} (expected bf16 or f32)",
             dtype_name(c_dtype));
  KILN_CHECK(!(a.format == ops::fp8::Format::e5m2 && b.format == ops::fp8::Format::e5m2), kOp,
             "e5m2 x e5m2 has no cuBLASLt kernel; one operand must be e4m3");
  check_operand(a, "A");
  check_operand(b, "B");
  const int32_t a_mode = scale_mode(a.block, "A"), b_mode = scale_mode(b.block, "B");
  const bool tensorwise = a_mode == CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
  KILN_CHECK(tensorwise == (b_mode == CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F), kOp,
             "operands A and B must both be tensorwise or both blockwise");
  // The 1 x 128 / 128 x 128 scale modes give a bf16 output only, as PyTorch's blockwise
  // _scaled_mm tests say ("only bf16 output type is supported for non-tensorwise scaling").
  KILN_CHECK(tensorwise || c_dtype == DType::bf16, kOp,
             "blockwise-scaled operands give a bf16 output only (cuBLASLt on Hopper), not {}", dtype_name(c_dtype));
  Plan& plan = plan_for({m, n, k, a.format, b.format, a_mode, b_mode, c_dtype}, a.scale_inv, b.scale_inv);
  // The scale pointers change from call to call; the rest of the descriptor is the problem's.
  set_scale_pointers(plan.op, a.scale_inv, b.scale_inv);
  const cudaStream_t s = stream(ctx);
  const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  check_lt(cublasLtMatmul(lt().handle, plan.op, &alpha, b.codes, plan.first, a.codes, plan.second, &beta, c, plan.out,
                          c, plan.out, &plan.algo, lt().workspace(s), kWorkspaceBytes, s),
           "cublasLtMatmul");
}

}  // namespace kiln::cuda

#include "ops/linear/linear.h"

#include "core/op_profiler.h"
#include "ops/blas.h"
#include "ops/common.h"
#include "ops/linear/linear_cuda.h"

#include <omp.h>

#include <algorithm>

namespace kiln::ops {

namespace {

// OpenBLAS's own threading of one product (its OpenMP build) synchronizes its threads by
// spinning on shared flags with sched_yield between them. A spinning thread whose partner
// is descheduled burns its time slice: on a loaded machine (ctest -j2 on two cores, each
// test training with two threads) kiln's small products ran several times slower than on
// one thread and spent more CPU. So kiln splits a product itself: C's rows (or, for a wide
// C, its columns) in one contiguous part per OpenMP thread, each part a single-threaded
// BLAS call (OpenBLAS runs on the calling thread inside an active parallel region), and an
// OpenMP barrier (passive waiting) at the end. Every element is still one BLAS dot product
// over k in BLAS's order; only which call computes it changes.
constexpr double kSplitWork = 65536.0 * 4;  // m n k under which OpenBLAS stays on one thread too
constexpr int64_t kMinPart = 16;            // rows (or columns) per part at least

template <typename T, typename Gemm>
void split_gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b,
                int64_t ldb, T beta, T* c, int64_t ldc, Gemm gemm) {
  const bool by_rows = m >= n;
  const int64_t extent = by_rows ? m : n;
  const int64_t threads = omp_in_parallel() ? 1 : omp_get_max_threads();
  const int64_t parts = std::min(threads, extent / kMinPart);
  if (parts <= 1 || static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k) <= kSplitWork) {
    gemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
#pragma omp parallel num_threads(static_cast<int>(parts))
  {
    const int64_t team = omp_get_num_threads(), t = omp_get_thread_num();  // the team may be smaller
    const int64_t lo = extent * t / team, hi = extent * (t + 1) / team;
    if (hi > lo) {
      if (by_rows)
        gemm(ta, tb, hi - lo, n, k, alpha, ta ? a + lo : a + lo * lda, lda, b, ldb, beta, c + lo * ldc, ldc);
      else
        gemm(ta, tb, m, hi - lo, k, alpha, a, lda, tb ? b + lo * ldb : b + lo, ldb, beta, c + lo, ldc);
    }
  }
}

}  // namespace

template <>
void cpu_gemm<float>(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
                     const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  split_gemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc,
             [](bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
                const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
               blas().sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
                            static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), alpha, a,
                            static_cast<int>(lda), b, static_cast<int>(ldb), beta, c, static_cast<int>(ldc));
             });
}

template <>
void cpu_gemm<double>(bool ta, bool tb, int64_t m, int64_t n, int64_t k, double alpha, const double* a,
                      int64_t lda, const double* b, int64_t ldb, double beta, double* c, int64_t ldc) {
  split_gemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc,
             [](bool ta, bool tb, int64_t m, int64_t n, int64_t k, double alpha, const double* a, int64_t lda,
                const double* b, int64_t ldb, double beta, double* c, int64_t ldc) {
               blas().dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
                            static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), alpha, a,
                            static_cast<int>(lda), b, static_cast<int>(ldb), beta, c, static_cast<int>(ldc));
             });
}

namespace {

// Activations and weights share one dtype; on the GPU's mixed path (bf16 activations)
// the bias and the parameter gradients stay fp32.
bool mixed(const Tensor& x) { return x.device() == Device::cuda && x.dtype() == DType::bf16; }

void expect_param(const char* op, const char* name, const Tensor& t, const Tensor& x, Shape shape) {
  if (mixed(x)) {
    expect_tensor(op, name, t, shape, DType::f32, x.device());
  } else {
    expect_shape(op, name, t, shape);
    expect_same(op, name, t, x);
  }
}

void validate(const char* op, const Tensor& x, const Tensor& w, const Tensor& bias) {
  expect_rank(op, "x", x, 2);
  expect_rank(op, "w", w, 2);
  expect_same(op, "w", w, x);
  KILN_CHECK(x.size(1) == w.size(1), op, "x {} and w {} disagree on in_features", x.describe(), w.describe());
  if (bias.defined()) expect_param(op, "bias", bias, x, Shape{w.size(0)});
}

[[maybe_unused]] void* raw_or_null(const Tensor& t) { return t.defined() ? t.raw() : nullptr; }

}  // namespace

void linear_forward(const ExecContext& ctx, const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& y) {
  const char* op = "linear";
  KILN_OP_SCOPE(op, x);
  validate(op, x, w, bias);
  expect_shape(op, "y", y, Shape{x.size(0), w.size(0)});
  expect_same(op, "y", y, x);
  KILN_CHECK(x.device() == Device::cpu || x.dtype() == DType::f32 || x.dtype() == DType::bf16, op,
             "the GPU computes in f32 or bf16, got {}", x.describe());
  KILN_ON_CUDA(x, op, cuda::linear_forward(ctx, x.raw(), w.raw(), x.dtype(), bias.data_or_null<float>(), x.size(0), x.size(1),
                                           w.size(0), y.raw()));
  dispatch_cpu_float(op, x.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const int64_t n = x.size(0), in = x.size(1), out = w.size(0);
    T* yp = y.data<T>();
    if (bias.defined()) {
      const T* bp = bias.data<T>();
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < out; ++j) yp[i * out + j] = bp[j];
    }
    cpu_gemm<T>(false, true, n, out, in, T(1), x.data<T>(), in, w.data<T>(), in, bias.defined() ? T(1) : T(0), yp,
                out);
  });
}

void linear_backward(const ExecContext& ctx, const Tensor& x, const Tensor& w, const Tensor& dy, const Tensor& dx, const Tensor& dw,
                     const Tensor& dbias, bool accumulate_dx) {
  const char* op = "linear_backward";
  KILN_OP_SCOPE(op, x);
  validate(op, x, w, Tensor());
  expect_shape(op, "dy", dy, Shape{x.size(0), w.size(0)});
  expect_same(op, "dy", dy, x);
  if (dx.defined()) expect_shape(op, "dx", dx, x.shape()), expect_same(op, "dx", dx, x);
  if (dw.defined()) expect_param(op, "dw", dw, x, w.shape());
  if (dbias.defined()) expect_param(op, "dbias", dbias, x, Shape{w.size(0)});
  KILN_ON_CUDA(x, op, {
    KILN_CHECK(x.dtype() == DType::f32 || x.dtype() == DType::bf16, op, "the GPU computes in f32 or bf16, got {}",
               x.describe());
    cuda::linear_backward(ctx, x.raw(), w.raw(), dy.raw(), x.dtype(), x.size(0), x.size(1), w.size(0), raw_or_null(dx),
                          accumulate_dx, raw_or_null(dw), dw.defined() ? dw.dtype() : x.dtype(), dbias.data_or_null<float>());
  });
  dispatch_cpu_float(op, x.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const int64_t n = x.size(0), in = x.size(1), out = w.size(0);
    // dx [N, in] = dy [N, out] @ w [out, in]
    if (dx.defined())
      cpu_gemm<T>(false, false, n, in, out, T(1), dy.data<T>(), out, w.data<T>(), in, accumulate_dx ? T(1) : T(0),
                  dx.data<T>(), in);
    // dw [out, in] += dy^T [out, N] @ x [N, in]
    if (dw.defined())
      cpu_gemm<T>(true, false, out, in, n, T(1), dy.data<T>(), out, x.data<T>(), in, T(1), dw.data<T>(), in);
    if (dbias.defined()) {
      T* db = dbias.data<T>();
      const T* g = dy.data<T>();
      for (int64_t j = 0; j < out; ++j) {
        T sum = 0;
        for (int64_t i = 0; i < n; ++i) sum += g[i * out + j];
        db[j] += sum;
      }
    }
  });
}

}  // namespace kiln::ops

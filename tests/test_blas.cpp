// The CPU path's BLAS: the kernels kiln loads (src/ops/blas.cpp) are the ones it asked
// for, and their GEMMs agree with a naive reference in every layout kiln uses and at
// awkward sizes, with 1 thread and with all cores. OpenBLAS kernels have given wrong
// results on CPUs newer than their release before, so speed alone proves nothing.
//
// Two checks per case:
//   exact: A, B and C hold small integers (|a|, |b| <= 8, |c| <= 16) and alpha, beta are
//     powers of two, so every product, partial sum and result is a multiple of 1/2 below
//     4096 * 64 + 32 < 2^19 in magnitude (k <= 4096), exact in fp32: any correct GEMM, in
//     any summation order, with or without FMA, returns exactly the reference, and every
//     difference is a bug;
//   rounded: uniform values in [-1, 1); |c - ref| <= (k + 3) u (|alpha| sum_p |a_ip b_pj| +
//     |beta c_ij|), the worst-case bound for any order of summation (u = 2^-24 in fp32,
//     2^-53 in fp64; the reference is fp64, long double for the fp64 GEMM).
// C's padding columns (ldc > n) hold NaN and must keep it (no writes out of bounds), and
// with beta = 0, C holds NaN before the call (BLAS must overwrite it, not scale it).
#include "core/rng.h"
#include "grad_check.h"
#include "ops/blas.h"
#include "ops/linear/linear.h"
#include "ops/parallel.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>
#include <thread>
#include <vector>

namespace kiln {
namespace {

using kiln::test::ScopedCpuThreads;

struct GemmCase {
  bool trans_a, trans_b;
  int64_t m, n, k;
};

std::string describe(const GemmCase& c) {
  return fmt::format("{}{} m={} n={} k={}", c.trans_a ? 'T' : 'N', c.trans_b ? 'T' : 'N', c.m, c.n, c.k);
}

// The default config's GEMMs (hidden 192, ffn 512, 4096 tokens, vocab 259 in chunks of
// 1024 rows), with the beta kiln passes: linear y = x W^T (NT, beta 0), dx = dy W (NN,
// beta 0), dW += dy^T x (TN, beta 1), and the LM head's three.
struct ModelGemm {
  GemmCase shape;
  float beta;
};
const ModelGemm kModelGemms[] = {
    {{false, true, 4096, 192, 192}, 0},  {{false, true, 4096, 512, 192}, 0}, {{false, false, 4096, 192, 512}, 0},
    {{true, false, 512, 192, 4096}, 1},  {{false, true, 1024, 259, 192}, 0}, {{false, false, 1024, 192, 259}, 0},
    {{true, false, 259, 192, 1024}, 1},
};

// Sizes around the kernels' block and vector edges, 24 random triples in each layout.
std::vector<GemmCase> awkward_cases() {
  const int64_t sizes[] = {1, 2, 3, 5, 7, 8, 15, 16, 17, 31, 32, 33, 47, 63, 64, 65, 95, 127, 129, 191, 255, 257};
  const uint64_t count = std::size(sizes);
  std::vector<GemmCase> cases;
  Rng rng(20261201);
  for (int layout = 0; layout < 4; ++layout)
    for (int i = 0; i < 24; ++i)
      cases.push_back({(layout & 1) != 0, (layout & 2) != 0, sizes[rng.below(count)], sizes[rng.below(count)],
                       sizes[rng.below(count)]});
  return cases;
}

enum class Values { small_integers, uniform };

template <typename T>
struct Operands {
  int64_t lda, ldb, ldc;
  std::vector<T> a, b, c;
};

// Row-major op(A) [m, k], op(B) [k, n], C [m, n]; every leading dimension padded by 3 so
// the kernels cannot assume packed rows.
template <typename T>
Operands<T> make_operands(const GemmCase& g, Values values, uint64_t seed, bool c_is_nan) {
  Rng rng(seed);
  auto draw = [&](double integer_bound) {
    if (values == Values::small_integers)
      return static_cast<T>(static_cast<int64_t>(rng.below(2 * static_cast<uint64_t>(integer_bound) + 1)) -
                            static_cast<int64_t>(integer_bound));
    return static_cast<T>(2 * rng.uniform() - 1);
  };
  Operands<T> o;
  const int64_t a_rows = g.trans_a ? g.k : g.m, a_cols = g.trans_a ? g.m : g.k;
  const int64_t b_rows = g.trans_b ? g.n : g.k, b_cols = g.trans_b ? g.k : g.n;
  o.lda = a_cols + 3;
  o.ldb = b_cols + 3;
  o.ldc = g.n + 3;
  const T nan = std::numeric_limits<T>::quiet_NaN();
  o.a.assign(a_rows * o.lda, nan);
  o.b.assign(b_rows * o.ldb, nan);
  o.c.assign(g.m * o.ldc, nan);
  for (int64_t r = 0; r < a_rows; ++r)
    for (int64_t j = 0; j < a_cols; ++j) o.a[r * o.lda + j] = draw(8);
  for (int64_t r = 0; r < b_rows; ++r)
    for (int64_t j = 0; j < b_cols; ++j) o.b[r * o.ldb + j] = draw(8);
  if (!c_is_nan)
    for (int64_t i = 0; i < g.m; ++i)
      for (int64_t j = 0; j < g.n; ++j) o.c[i * o.ldc + j] = draw(16);
  return o;
}

// C = alpha op(A) op(B) + beta C in Wide (fp64 or long double), with the magnitude
// |alpha| sum |a b| + |beta c| that bounds the rounding error. op(A)'s rows and op(B)'s
// columns are copied out first so the dot products read contiguous memory.
template <typename Wide>
struct Reference {
  std::vector<Wide> c, magnitude;
};

template <typename T, typename Wide>
Reference<Wide> reference_gemm(const GemmCase& g, const Operands<T>& o, T alpha, T beta) {
  std::vector<Wide> a_rows(g.m * g.k), b_cols(g.n * g.k);
  for (int64_t i = 0; i < g.m; ++i)
    for (int64_t p = 0; p < g.k; ++p) a_rows[i * g.k + p] = g.trans_a ? o.a[p * o.lda + i] : o.a[i * o.lda + p];
  for (int64_t j = 0; j < g.n; ++j)
    for (int64_t p = 0; p < g.k; ++p) b_cols[j * g.k + p] = g.trans_b ? o.b[j * o.ldb + p] : o.b[p * o.ldb + j];
  Reference<Wide> ref{std::vector<Wide>(g.m * g.n), std::vector<Wide>(g.m * g.n)};
  for (int64_t i = 0; i < g.m; ++i) {
    for (int64_t j = 0; j < g.n; ++j) {
      const Wide* a = &a_rows[i * g.k];
      const Wide* b = &b_cols[j * g.k];
      Wide sum = 0, abs_sum = 0;
      for (int64_t p = 0; p < g.k; ++p) {
        sum += a[p] * b[p];
        abs_sum += std::abs(a[p] * b[p]);
      }
      const Wide c = beta == T(0) ? Wide(0) : Wide(beta) * Wide(o.c[i * o.ldc + j]);
      ref.c[i * g.n + j] = Wide(alpha) * sum + c;
      ref.magnitude[i * g.n + j] = std::abs(Wide(alpha)) * abs_sum + std::abs(c);
    }
  }
  return ref;
}

// Runs the GEMM with 1 thread and with all cores on fresh copies of C and returns the
// number of elements that disagree with the reference (exactly, for small integers; else
// beyond the rounding bound) plus padding elements written; the first few are reported.
template <typename T, typename Wide>
int64_t check_gemm(const GemmCase& g, Values values, T alpha, T beta, uint64_t seed) {
  const Operands<T> o = make_operands<T>(g, values, seed, beta == T(0));
  const Reference<Wide> ref = reference_gemm<T, Wide>(g, o, alpha, beta);
  const Wide unit_roundoff = std::numeric_limits<T>::epsilon() / 2;
  int64_t bad = 0;
  for (int threads : {1, static_cast<int>(std::thread::hardware_concurrency())}) {
    ScopedCpuThreads scoped(threads);
    std::vector<T> c = o.c;
    ops::cpu_gemm<T>(g.trans_a, g.trans_b, g.m, g.n, g.k, alpha, o.a.data(), o.lda, o.b.data(), o.ldb, beta, c.data(),
                     o.ldc);
    for (int64_t i = 0; i < g.m; ++i) {
      for (int64_t j = 0; j < o.ldc; ++j) {
        const T got = c[i * o.ldc + j];
        bool ok;
        std::string expected;
        if (j >= g.n) {
          ok = std::isnan(got);
          expected = "untouched padding (NaN)";
        } else {
          const Wide want = ref.c[i * g.n + j];
          const Wide bound = values == Values::small_integers
                                 ? Wide(0)
                                 : Wide(g.k + 3) * unit_roundoff * ref.magnitude[i * g.n + j];
          ok = std::isfinite(got) && std::abs(Wide(got) - want) <= bound;
          expected = fmt::format("{} +- {}", static_cast<double>(want), static_cast<double>(bound));
        }
        if (!ok && ++bad <= 3)
          ADD_FAILURE() << describe(g) << " alpha " << alpha << " beta " << beta << ", " << threads << " threads: C["
                        << i << "," << j << "] = " << got << ", expected " << expected;
      }
    }
  }
  return bad;
}

// Each awkward shape in five variants: exact with beta 0 (C NaN before), 1 and -2, and
// rounded with beta 0 and 1.3.
template <typename T, typename Wide>
int64_t check_awkward_shapes() {
  uint64_t seed = 1;
  int64_t bad = 0;
  for (const GemmCase& g : awkward_cases()) {
    bad += check_gemm<T, Wide>(g, Values::small_integers, T(1), T(0), seed++);
    bad += check_gemm<T, Wide>(g, Values::small_integers, T(0.5), T(1), seed++);
    bad += check_gemm<T, Wide>(g, Values::small_integers, T(1), T(-2), seed++);
    bad += check_gemm<T, Wide>(g, Values::uniform, T(1), T(0), seed++);
    bad += check_gemm<T, Wide>(g, Values::uniform, T(0.7), T(1.3), seed++);
  }
  return bad;
}

// The kernels in use are the ones kiln chose from the CPU's features (or the user's
// OPENBLAS_CORETYPE), and the variable kiln set for OpenBLAS is gone again.
TEST(Blas, LoadsTheKernelsKilnChose) {
  const char* variable = std::getenv("OPENBLAS_CORETYPE");
  const std::string user_core = variable ? variable : "";
  const bool variable_was_set = variable != nullptr;
  const BlasInfo& info = blas_info();
  std::printf("blas: %s from %s\n", blas_summary().c_str(), info.path.c_str());
  EXPECT_EQ(info.library.rfind("OpenBLAS ", 0), 0u) << info.library;
  if (!user_core.empty()) {
    EXPECT_EQ(info.chosen_by, "OPENBLAS_CORETYPE");
  } else if (const std::string preferred = preferred_openblas_core(); !preferred.empty()) {
    EXPECT_EQ(info.chosen_by, "kiln");
    EXPECT_EQ(info.core, preferred);
    // The environment is the user's again: unset, or set but empty, as it was.
    const char* after = std::getenv("OPENBLAS_CORETYPE");
    EXPECT_EQ(after != nullptr, variable_was_set) << "kiln's choice leaked into the environment";
    if (after) EXPECT_STREQ(after, "");
  } else {
    EXPECT_EQ(info.chosen_by, "OpenBLAS");
  }
}

// fp32 is what the CPU path trains in: the model's shapes, then the awkward ones.
TEST(Blas, SgemmMatchesNaiveReference) {
  SCOPED_TRACE(blas_summary());
  uint64_t seed = 1000;
  int64_t bad = 0;
  for (const ModelGemm& model : kModelGemms) {
    bad += check_gemm<float, double>(model.shape, Values::small_integers, 1.0f, model.beta, seed++);
    bad += check_gemm<float, double>(model.shape, Values::uniform, 1.0f, model.beta, seed++);
  }
  bad += check_awkward_shapes<float, double>();
  EXPECT_EQ(bad, 0);
}

// fp64 serves the gradient checks' reference side.
TEST(Blas, DgemmMatchesNaiveReference) {
  SCOPED_TRACE(blas_summary());
  EXPECT_EQ((check_awkward_shapes<double, long double>()), 0);
}

}  // namespace
}  // namespace kiln

#include "ops/fp8/fp8_gemm_reference.h"

#include "core/error.h"

namespace kiln::ops::fp8 {

std::vector<float> gemm_reference(const ScaledMatrix& a, const ScaledMatrix& b) {
  KILN_CHECK(a.cols == b.cols, "fp8", "gemm_reference: A is [{}, {}] and B is [{}, {}]; their K (cols) must match",
             a.rows, a.cols, b.rows, b.cols);
  const std::vector<float> a_values = dequantize(a);
  const std::vector<float> b_values = dequantize(b);
  const int64_t m = a.rows, n = b.rows, k = a.cols;
  std::vector<float> c(m * n);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      const float* a_row = a_values.data() + i * k;
      const float* b_row = b_values.data() + j * k;
      float sum = 0;
      for (int64_t p = 0; p < k; ++p) sum += a_row[p] * b_row[p];  // -ffp-contract=off: no FMA
      c[i * n + j] = sum;
    }
  return c;
}

}  // namespace kiln::ops::fp8

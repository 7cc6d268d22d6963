// What the Muon tests (test_muon.cpp, gpu/test_gpu_muon.cpp) measure an orthogonalized
// matrix with: its singular values (a cyclic Jacobi eigen-solver on the Gram matrix, in
// double), the quintic's prediction of each, and the band the iteration leaves them in.
#pragma once

#include "ops/optim/muon.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

namespace kiln::muon_test {

// Eigenvalues of the symmetric n x n matrix `a` (row-major, destroyed), descending.
inline std::vector<double> symmetric_eigenvalues(std::vector<double> a, int64_t n) {
  auto at = [&](int64_t i, int64_t j) -> double& { return a[static_cast<size_t>(i * n + j)]; };
  for (int sweep = 0; sweep < 100; ++sweep) {
    double off = 0, diag = 0;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < n; ++j) (i == j ? diag : off) += at(i, j) * at(i, j);
    if (off <= 1e-32 * diag) break;
    for (int64_t p = 0; p < n; ++p)
      for (int64_t q = p + 1; q < n; ++q) {
        if (at(p, q) == 0) continue;
        // The rotation that zeroes a_pq (Numerical Recipes' jacobi): A <- J^T A J.
        const double theta = (at(q, q) - at(p, p)) / (2 * at(p, q));
        const double t = (theta >= 0 ? 1.0 : -1.0) / (std::abs(theta) + std::sqrt(theta * theta + 1));
        const double c = 1 / std::sqrt(t * t + 1), s = t * c;
        for (int64_t k = 0; k < n; ++k) {
          const double kp = at(k, p), kq = at(k, q);
          at(k, p) = c * kp - s * kq, at(k, q) = s * kp + c * kq;
        }
        for (int64_t k = 0; k < n; ++k) {
          const double pk = at(p, k), qk = at(q, k);
          at(p, k) = c * pk - s * qk, at(q, k) = s * pk + c * qk;
        }
      }
  }
  std::vector<double> values(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) values[static_cast<size_t>(i)] = at(i, i);
  std::sort(values.begin(), values.end(), std::greater<>());
  return values;
}

// Singular values of x [rows, cols] (row-major), descending: square roots of the
// eigenvalues of the smaller Gram matrix, X X^T or X^T X.
inline std::vector<double> singular_values(const std::vector<double>& x, int64_t rows, int64_t cols) {
  const bool wide = rows <= cols;
  const int64_t n = wide ? rows : cols, k = wide ? cols : rows;
  auto elem = [&](int64_t i, int64_t j) {  // element (i, j) of the wide orientation [n, k]
    return wide ? x[static_cast<size_t>(i * cols + j)] : x[static_cast<size_t>(j * cols + i)];
  };
  std::vector<double> gram(static_cast<size_t>(n * n));
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double s = 0;
      for (int64_t l = 0; l < k; ++l) s += elem(i, l) * elem(j, l);
      gram[static_cast<size_t>(i * n + j)] = s;
    }
  std::vector<double> values = symmetric_eigenvalues(std::move(gram), n);
  for (double& v : values) v = std::sqrt(std::max(v, 0.0));
  return values;
}

// The quintic p(s) = a s + b s^3 + c s^5, applied `steps` times.
inline double quintic(double s, int steps) {
  for (int i = 0; i < steps; ++i) {
    const double s2 = s * s;
    s = ops::kNewtonSchulzA * s + ops::kNewtonSchulzB * s * s2 + ops::kNewtonSchulzC * s * s2 * s2;
  }
  return s;
}

// [min, max] of the quintic's `steps`-fold iterate over s in [lo, 1] (a fine geometric
// grid): the band an input whose normalized singular values lie in [lo, 1] comes out in.
inline std::pair<double, double> quintic_band(double lo, int steps) {
  double mn = INFINITY, mx = -INFINITY;
  const int points = 200000;
  for (int i = 0; i <= points; ++i) {
    const double s = lo * std::pow(1 / lo, static_cast<double>(i) / points);
    const double v = quintic(s, steps);
    mn = std::min(mn, v), mx = std::max(mx, v);
  }
  return {mn, mx};
}

}  // namespace kiln::muon_test

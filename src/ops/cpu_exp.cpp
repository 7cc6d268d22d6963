#include "ops/cpu_exp.h"

#include <cmath>
#include <cstring>

namespace kiln::cpu {

namespace {

using f32x8 = float __attribute__((vector_size(32)));
using i32x8 = int32_t __attribute__((vector_size(32)));

f32x8 exp_f32x8(f32x8 x) {
  constexpr float kMax = 88.3762626647949f, kMin = -87.3365478515625f;
  const f32x8 zero = {};
  const f32x8 lo = x < kMin ? zero + kMin : x;  // NaN compares false: kept
  const f32x8 xc = lo > kMax ? zero + kMax : lo;
  const f32x8 n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  f32x8 r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  f32x8 p = zero + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const f32x8 y = p * (r * r) + r + 1.0f;
  const i32x8 bits = (__builtin_convertvector(n, i32x8) + 127) << 23;  // 2^n, n in [-126, 127]
  f32x8 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  const f32x8 e = y * scale;
  return x < kMin ? zero : (x > kMax ? zero + INFINITY : e);
}

// y[i] = exp(sign x[i] - shift) for i < n, eight at a time; the last partial group through
// the same lanes (zero-padded).
template <bool kNegate>
void exp_lanes(const float* x, float* y, int64_t n, float shift) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    f32x8 v;
    std::memcpy(&v, x + i, sizeof v);
    v = exp_f32x8((kNegate ? -v : v) - shift);
    std::memcpy(y + i, &v, sizeof v);
  }
  if (i < n) {
    const size_t bytes = sizeof(float) * static_cast<size_t>(n - i);
    f32x8 v = {};
    std::memcpy(&v, x + i, bytes);
    v = exp_f32x8((kNegate ? -v : v) - shift);
    std::memcpy(y + i, &v, bytes);
  }
}

}  // namespace

void exp_shifted(float* x, int64_t n, float shift) { exp_lanes<false>(x, x, n, shift); }

void exp_shifted(double* x, int64_t n, double shift) {
  for (int64_t i = 0; i < n; ++i) x[i] = std::exp(x[i] - shift);
}

void exp_negated(const float* x, float* y, int64_t n) { exp_lanes<true>(x, y, n, 0.0f); }

void exp_negated(const double* x, double* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = std::exp(-x[i]);
}

}  // namespace kiln::cpu

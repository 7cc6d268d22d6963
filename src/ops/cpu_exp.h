// exp over a block of values for the CPU path's hot loops (the attention softmax, SwiGLU's
// sigmoid), eight lanes at a time. libm's expf is a call per element that no loop
// vectorizes (glibc declares its vector variants only under -ffast-math), and the
// attention softmax spent more time in it than in its products; this one is eight lanes of
// plain arithmetic (cpu_exp.cpp: GCC/Clang vector extensions, AVX2 with kiln's x86-64-v3
// flags, SSE pairs or scalars elsewhere).
//
// The float exp is Cephes' expf: exp(x) = 2^n exp(r), n = round(x log2 e), r = x - n ln 2
// (ln 2 in two parts), exp(r) = 1 + r + r^2 P(r) with P of degree 5. Within 1.01 ulp of
// the exact value for floats in [-87.33, 88.37] (tests/test_ops_properties.cpp checks a
// sample of every binade against the double exp); below, 0 (the exact values there are
// subnormal, under 1.2e-38); above, +inf; NaN stays NaN. Every lane, including a short
// block's last partial group, goes through the same vector code, so a value's result does
// not depend on where in a block it sits. double (the reference's f64 path) keeps std::exp.
#pragma once

#include <cstdint>

namespace kiln::cpu {

// x[i] = exp(x[i] - shift) for i < n.
void exp_shifted(float* x, int64_t n, float shift);
void exp_shifted(double* x, int64_t n, double shift);

// y[i] = exp(-x[i]) for i < n (y may be x).
void exp_negated(const float* x, float* y, int64_t n);
void exp_negated(const double* x, double* y, int64_t n);

}  // namespace kiln::cpu

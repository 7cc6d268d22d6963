// The CPU reference behind ops/rms_norm/rms_norm.h (rms_norm_cpu.cpp), f32 and f64.
// Inputs are validated by the front end.
#pragma once

#include <cstdint>

namespace kiln::cpu {
template <typename T>
void rms_norm_forward(const T* x, const T* w, double eps, int64_t rows, int64_t cols, T* y, T* rstd);
template <typename T>
void rms_norm_backward(const T* x, const T* w, const T* rstd, const T* dy, int64_t rows, int64_t cols, T* dx, T* dw,
                       bool accumulate_dx);
}  // namespace kiln::cpu

// Backend kernels behind ops/rms_norm/rms_norm.h. Inputs are validated by the front end.
#pragma once

#include <cstdint>

namespace kiln::cpu {
template <typename T>
void rms_norm_forward(const T* x, const T* w, double eps, int64_t rows, int64_t cols, T* y, T* rstd);
template <typename T>
void rms_norm_backward(const T* x, const T* w, const T* rstd, const T* dy, int64_t rows, int64_t cols, T* dx, T* dw,
                       bool accumulate_dx);
}  // namespace kiln::cpu

namespace kiln::cuda {
// fp32 tensors on the device; `stream` is a cudaStream_t.
void rms_norm_forward_f32(const float* x, const float* w, float eps, int64_t rows, int64_t cols, float* y,
                          float* rstd, void* stream);
void rms_norm_backward_f32(const float* x, const float* w, const float* rstd, const float* dy, int64_t rows,
                           int64_t cols, float* dx, float* dw, bool accumulate_dx, void* stream);
}  // namespace kiln::cuda

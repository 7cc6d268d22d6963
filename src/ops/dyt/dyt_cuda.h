// CUDA kernels behind ops/dyt/dyt.h (dyt_cuda.cu). One templated kernel pair serves both
// GPU paths, chosen by the dtypes passed:
//   fp32:  x, y, dy, dx fp32;
//   mixed: x fp32 (the residual stream) or bf16 (q/k heads), y and dy bf16, dx of x's dtype;
// alpha, w, b and their gradients fp32, all arithmetic fp32. bf16 values cross this header as
// their 16 bits so host code needs no CUDA headers. The front end validates; these trust
// their inputs. Both launch on the context's stream (the backward's sums go through the
// context's scratch, core/context_scratch.h). No output may alias an input.
#pragma once

#include "core/dtype.h"
#include "core/exec_context.h"

#include <cstdint>

namespace kiln::cuda {

// y = tanh(alpha x) w + b; w, b null: ones / zeros.
void dyt_forward(const ExecContext& ctx, const void* x, DType x_dtype, const float* alpha, const float* w, const float* b, int64_t rows,
                 int64_t cols, void* y, DType y_dtype);

// dx (x_dtype) = or +=; dalpha [1], dw, db [cols] += (null: skipped), each summed through
// per-block partials added in a fixed order; dx_copy (null: none; y_dtype) receives dx.
void dyt_backward(const ExecContext& ctx, const void* x, DType x_dtype, const float* alpha, const float* w, const void* dy, DType y_dtype,
                  int64_t rows, int64_t cols, void* dx, bool accumulate_dx, float* dalpha, float* dw, float* db,
                  void* dx_copy);

}  // namespace kiln::cuda

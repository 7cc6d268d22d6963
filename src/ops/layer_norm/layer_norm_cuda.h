// CUDA kernels behind ops/layer_norm/layer_norm.h (layer_norm_cuda.cu). One templated
// kernel serves both GPU paths, chosen by the dtypes passed:
//   fp32:  x, y, dy, dx fp32;
//   mixed: x fp32 (the residual stream) or bf16, y and dy bf16, dx of x's dtype;
// gains, biases, mean, rstd and their gradients are fp32 in both, all arithmetic fp32.
// bf16 values cross this header as their 16 bits (uint16_t) so host code needs no CUDA
// headers. The front end validates shapes and dtypes; these trust their inputs. Both launch
// on the context's stream (the backward's column sums go through the context's scratch,
// core/context_scratch.h). No output may alias an input.
#pragma once

#include "core/dtype.h"
#include "core/exec_context.h"

#include <cstdint>

namespace kiln::cuda {

// x [rows, cols] of x_dtype (f32 or bf16) -> y [rows, cols] of y_dtype (f32, or bf16);
// mean, rstd [rows]. w, b [cols] (null: ones / zeros). With branch (y_dtype, [rows, cols];
// f32 x only) the input is x + branch, also written to sum (f32, [rows, cols]): the
// residual add fused in.
void layer_norm_forward(const ExecContext& ctx, const void* x, DType x_dtype, const float* w, const float* b, float eps, int64_t rows,
                        int64_t cols, void* y, DType y_dtype, float* mean, float* rstd, const void* branch = nullptr,
                        float* sum = nullptr);

// dy of y_dtype; dx of x_dtype, written (=) or accumulated (+=); dw, db [cols] (null:
// skipped) accumulated (+=) in an order fixed by the shape, so the same bits every run;
// dx_copy (null: none; y_dtype) receives dx's final values.
void layer_norm_backward(const ExecContext& ctx, const void* x, DType x_dtype, const float* w, const float* mean, const float* rstd,
                         const void* dy, DType y_dtype, int64_t rows, int64_t cols, void* dx, bool accumulate_dx,
                         float* dw, float* db, void* dx_copy = nullptr);

}  // namespace kiln::cuda

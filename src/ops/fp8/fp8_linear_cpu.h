// The CPU reference of an FP8 linear layer's arithmetic (the fp8_tensorwise and fp8_blockwise recipes' GEMMs,
// nn/linear_layer.h), on fp32 buffers the caller plans: the same bits as quantize_tensorwise
// + dequantize + gemm_reference (ops/fp8/fp8_scaling.h, fp8_gemm_reference.h), without their
// per-call vectors, and with the GEMM's rows split over OpenMP threads (each output is still
// one ascending-k sum of fp32-rounded products, so the thread count changes no bit).
#pragma once

#include "ops/fp8/fp8_format.h"
#include "ops/fp8/fp8_scaling.h"

#include <cstdint>

namespace kiln::ops::fp8 {

// x [rows, cols] quantized per tensor to `format` (current scaling: this call's amax) and
// dequantized into out: decode(code) * scale_inv, so out holds exactly the values the FP8
// GEMM multiplies. out is [rows, cols], or [cols, rows] when `transpose` (the same codes at
// the transposed places). A non-finite element is an error naming `what`.
void quantize_dequantize_tensorwise(const float* x, int64_t rows, int64_t cols, Format format, float* out,
                                    bool transpose, const char* what);

// The same per block (DeepSeek-V3's blockwise scaling, quantize()'s blocks, a partial block
// at an edge its own): each block's amax, scale and codes, dequantized into out ([rows,
// cols], or [cols, rows] when `transpose`). A non-finite element is an error naming `what`.
void quantize_dequantize_blockwise(const float* x, int64_t rows, int64_t cols, BlockShape block, Format format,
                                   float* out, bool transpose, const char* what);

// y [n, out] += bias [out] in fp32, row by row: an FP8 layer's bias, added after the product.
void add_bias_rows(float* y, const float* bias, int64_t n, int64_t out);

// C [m, n] (= or += when accumulate) from A and B: c_ij = sum over p ascending of
// fl(a_ip * b_pj) in fp32 (no FMA), the sum formed from 0 and then added to C; A is read at
// a[i * a_row + p * a_col], B is [k, n] row-major. `scratch` (m * n floats) is needed only
// when accumulating.
void gemm_rounded(int64_t m, int64_t n, int64_t k, const float* a, int64_t a_row, int64_t a_col, const float* b,
                  float* c, bool accumulate, float* scratch);

}  // namespace kiln::ops::fp8

// CUDA kernels behind ops/rms_norm/rms_norm.h: fp32 (rms_norm_cuda.cu) and the mixed
// path's (rms_norm_bf16.cu, layout in ops/mixed_precision.h). They launch on the context's
// stream and trust their inputs.
#pragma once

#include "core/dtype.h"
#include "core/exec_context.h"
#include "ops/mixed_precision.h"

#include <cstdint>

namespace kiln::cuda {

// fp32 tensors on the device.
void rms_norm_forward_f32(const ExecContext& ctx, const float* x, const float* w, float eps, int64_t rows, int64_t cols,
                          float* y, float* rstd);
void rms_norm_backward_f32(const ExecContext& ctx, const float* x, const float* w, const float* rstd, const float* dy,
                           int64_t rows, int64_t cols, float* dx, float* dw, bool accumulate_dx);

// RMSNorm with an fp32 gain: y = x * rstd * w, rstd = 1/sqrt(mean(x^2) + eps) (fp32, [rows]).
// x is fp32 (residual stream) or bf16; y is bf16. With b (bf16, a branch output; fp32 x
// only) the input is x + b, also written to sum (fp32): the residual add fused in. No
// output may alias an input.
void rms_norm_forward_mixed(const ExecContext& ctx, const void* x, DType x_dtype, const float* w, float eps, int64_t rows, int64_t cols,
                            bf16_bits* y, float* rstd, const bf16_bits* b = nullptr, float* sum = nullptr);
// dy bf16; dx has x's dtype and is written (=) or accumulated (+=, the fp32 residual
// gradient); dw (fp32, [cols]) is accumulated (+=) in a fixed order; dx_copy (null: none)
// receives dx's final values in bf16. With dw, it reduces through the context's device
// scratch (core/context_scratch.h).
void rms_norm_backward_mixed(const ExecContext& ctx, const void* x, DType x_dtype, const float* w, const float* rstd, const bf16_bits* dy,
                             int64_t rows, int64_t cols, void* dx, bool accumulate_dx, float* dw,
                             bf16_bits* dx_copy);

}  // namespace kiln::cuda

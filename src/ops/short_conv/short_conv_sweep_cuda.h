// The short convolution's "sweep" CUDA kernels (short_conv_sweep_cuda.cu): a thread per
// (channel, tile of tokens) running short_conv_sweep.h, chosen by model.kda.conv_gpu_kernel
// = "sweep" (ops::ShortConvGpuKernel). Same arguments and results as the per-element kernels
// of ops/kda/kda_mixer_cuda.h: x, y, dy, dx [n, ch] and w [ch, kernel] of dtype (f32 or
// bf16, fp32 math), dw [ch, kernel] fp32 (+=, null: skipped) through per-tile partial sums
// added in tile order (the same bits every run), cu_seqlens on the device.
#pragma once

#include "core/dtype.h"
#include "core/exec_context.h"

#include <cstdint>

namespace kiln::cuda {

void short_conv_sweep_forward(const ExecContext& ctx, DType dtype, const void* x, const void* w,
                              const int32_t* cu_seqlens, int64_t seqs, int64_t n, int64_t ch, int64_t kernel, void* y);
void short_conv_sweep_backward(const ExecContext& ctx, DType dtype, const void* x, const void* w,
                               const int32_t* cu_seqlens, int64_t seqs, int64_t n, int64_t ch, int64_t kernel,
                               const void* dy, void* dx, float* dw);

}  // namespace kiln::cuda

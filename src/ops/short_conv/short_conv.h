// The causal depthwise short convolution of KDA (and of Mamba and FLA's ShortConvolution),
// followed by SiLU, over packed documents:
//   y[t, c] = silu(sum_j w[c, j] x[t - K + 1 + j, c])      (j = 0 .. K-1)
// where rows before the start of t's document count as zero: documents never share inputs,
// as they share no attention. x, y [N, C], w [C, K], cu_seqlens i32 [S+1].
//
// CPU: f32, f64. GPU (ops/kda/kda_mixer_cuda.h): forward and backward, x, w, y f32 or bf16
// (fp32 math), dw fp32, cu_seqlens on the device; the decode step (ops/kda/kda_decode_cuda.h)
// with its state of x's dtype and slots on the device.
#pragma once

#include "core/exec_context.h"
#include "core/tensor.h"

namespace kiln::ops {

// The GPU's kernels (model.kda.conv_gpu_kernel): per_element, a thread per (token, channel);
// sweep, a thread per (channel, tile of tokens) keeping its window in registers
// (short_conv_sweep.h). The CPU ignores it.
enum class ShortConvGpuKernel { per_element, sweep };

void short_conv_forward(const ExecContext& ctx, const Tensor& x, const Tensor& w, const Tensor& cu_seqlens,
                        const Tensor& y, ShortConvGpuKernel gpu_kernel = ShortConvGpuKernel::per_element);

// From dy: dx (=) and dw (+=, skipped if undefined). The convolution is recomputed from x.
void short_conv_backward(const ExecContext& ctx, const Tensor& x, const Tensor& w, const Tensor& cu_seqlens,
                         const Tensor& dy, const Tensor& dx, const Tensor& dw,
                         ShortConvGpuKernel gpu_kernel = ShortConvGpuKernel::per_element);

// Decode: rows x [n, C] of the sequences in slots[i] (i32 [n], in position order within a
// slot), each continuing from state [slots, K-1, C] (that slot's last K-1 inputs, zero at a
// document's start) -> y [n, C]; the state advances by each row in turn.
void short_conv_step(const ExecContext& ctx, const Tensor& x, const Tensor& w, const Tensor& slots,
                     const Tensor& state, const Tensor& y);

}  // namespace kiln::ops

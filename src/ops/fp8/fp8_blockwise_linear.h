// A linear layer y = x W^T (+ b) with its GEMMs in DeepSeek-V3's blockwise FP8 (the
// fp8_blockwise recipe, nn/linear_layer.h). Every operand is e4m3 (fine-grained scales
// leave e5m2's range unneeded, as DeepSeek-V3 found), scaled per block with current
// scaling (each block's own amax, ops/fp8/fp8_scaling.h):
//
//   forward  y  = T(x) B(W)^T           x in 1 x 128 tiles along in, W in 128 x 128 blocks
//   dgrad    dx = T(dy) B(W)            dy in 1 x 128 tiles along out, W's blocks transposed
//   wgrad    dW += C(dy)^T C(x)         dy and x in 128 x 1 column tiles (along the tokens,
//                                       the product's K), so they are quantized apart from
//                                       the tiles above, with scales of their own
//
// products summed in fp32. The bias and its gradient stay out of FP8, as in fp8_tensorwise.
//
// CPU (f32 tensors): the emulation, quantize_dequantize_blockwise + gemm_rounded
// (fp8_linear_cpu.h), the recipe's reference, for any shape.
// GPU (bf16 activations and weights, f32 or bf16 weight gradient): fp8_quantize_blockwise
// (the column tiles written transposed in their own pass) and cuBLASLt's blockwise FP8 GEMM
// (fp8_gemm_cuda.h), which gives a bf16 output only: the weight gradient's product is
// therefore rounded to bf16 before it is added to an f32 gradient (its FP8 operands carry
// far larger errors than that rounding). A call whose n, in or out is not a multiple of 128
// (a decode step's few rows) runs the bf16 GEMM instead.
//
// Operand copies come from the workspace's gemm level (fp8_blockwise_linear_scratch_bytes).
// Nothing is kept from forward to backward: x's backward operand has other tiles than its
// forward one, so keeping it would save only a read of x.
#pragma once

#include "core/arena.h"
#include "core/exec_context.h"
#include "core/tensor.h"

#include <cstddef>
#include <cstdint>

namespace kiln::ops::fp8 {

// Workspace bytes one call needs at most (forward, or backward when training) for up to
// `tokens` rows of x.
size_t fp8_blockwise_linear_scratch_bytes(Device device, int64_t tokens, int64_t in, int64_t out, bool training);

// Whether this call's GEMMs run in FP8: always on the CPU; on the GPU when n, in and out
// are multiples of 128 (each product's K is one of them).
bool fp8_blockwise_linear_runs_fp8(Device device, int64_t n, int64_t in, int64_t out);

// x [n, in], w [out, in], bias [out] or undefined -> y [n, out] (written with =).
// vector_kernels: the GPU's quantize takes its vector kernels (cuda::fp8_quantize_blockwise).
void fp8_blockwise_linear_forward(const ExecContext& ctx, Workspace& workspace, const Tensor& x, const Tensor& w,
                                  const Tensor& bias, const Tensor& y, bool vector_kernels = false);

// dy [n, out]. dx [n, in] (= or += when accumulate_dx; skipped if undefined). dw [out, in]
// and dbias [out]: += (skipped if undefined or when x is). dx may be x's place.
void fp8_blockwise_linear_backward(const ExecContext& ctx, Workspace& workspace, const Tensor& x, const Tensor& w,
                                   const Tensor& dy, const Tensor& dx, bool accumulate_dx, const Tensor& dw,
                                   const Tensor& dbias, bool vector_kernels = false);

}  // namespace kiln::ops::fp8

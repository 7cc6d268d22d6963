// FP8 GEMM through cuBLASLt (fp8_gemm_cuda.cu): row-major C [m, n] = A [m, k] * B [n, k]^T
// from two quantized operands, both K-major (Hopper's FP8 tensor cores take only the "TN"
// layout), fp32 accumulation (fast accumulation off: cuBLASLt promotes partial sums to fp32
// periodically), output bf16 or f32. The same contract as ops::fp8::gemm_reference, which
// the GPU tests compare it with (docs/fp8.md). Training calls it through ops/fp8/fp8_linear.h.
//
// Scaling per operand: tensorwise (one device float scale_inv, cuBLASLt's
// A/B_SCALE_POINTER in SCALAR_32F mode) or DeepSeek-V3 blockwise (1 x 128 tiles or 128 x 128
// blocks, cuBLASLt 12.9+'s VEC128_32F / BLK128x128_32F modes, Hopper only), scale_inv in the
// layout of ops/fp8/fp8_quantize_cuda.h. cuBLASLt does not mix tensorwise with blockwise.
// Shapes: m, n, k multiples of 16 (cuBLASLt's FP8 requirement); others are refused with an
// error naming the dimension, the caller pads. Each problem's descriptors and the
// heuristic's first algorithm are made once and reused (same bits every call); the
// workspace is one per stream, allocated on the stream's first product (before any graph
// capture), as ops/linear/gemm_cuda.cu does.
#pragma once

#include "core/dtype.h"
#include "core/exec_context.h"
#include "ops/fp8/fp8_scaling.h"

#include <cstdint>

namespace kiln::cuda {

struct Fp8Operand {
  const uint8_t* codes = nullptr;  // [rows, k] row-major
  ops::fp8::Format format = ops::fp8::Format::e4m3;
  // {0, 0}: tensorwise (scale_inv one float); kActivationTile or kWeightBlock: blockwise.
  ops::fp8::BlockShape block{0, 0};
  const float* scale_inv = nullptr;  // device
};

inline constexpr ops::fp8::BlockShape kFp8Tensorwise{0, 0};

// C [m, n] (row-major, c_dtype bf16 or f32) = A [m, k] B [n, k]^T, or += when accumulate
// (beta = 1: a weight gradient summed over micro-batches, a bias already in C). e5m2 x e5m2
// is refused (no cuBLASLt kernel); e4m3 x e5m2 and e5m2 x e4m3 are the backward's GEMMs.
void fp8_gemm(const ExecContext& ctx, int64_t m, int64_t n, int64_t k, const Fp8Operand& a, const Fp8Operand& b,
              void* c, DType c_dtype, bool accumulate = false);

}  // namespace kiln::cuda

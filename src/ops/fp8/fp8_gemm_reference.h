// The CPU oracle for FP8 GEMMs (cuBLASLt's and CUTLASS's, per-tensor and blockwise scaled):
// C [M, N] = A [M, K] * B [N, K]^T, each operand dequantized with its own block scales
// (ops/fp8/fp8_scaling.h) and multiplied in fp32: every product rounded to fp32, summed in
// fp32 in ascending k. A kernel sums in another order (and DeepGEMM scales per 128-wide k
// chunk before adding), so kernels are compared with this within fp32 accumulation
// tolerance, |c - ref| <= (K + 4) * u * sum_k |a_ik b_jk|, not bit for bit (u = 2^-24 for
// fp32 accumulation; larger for tensor cores' in-MMA accumulation, docs/fp8.md).
#pragma once

#include "ops/fp8/fp8_scaling.h"

#include <vector>

namespace kiln::ops::fp8 {

// A.cols must equal B.cols (both are K-major, the layout FP8 tensor cores take). Any block
// shapes and either format on either side (e4m3 x e5m2 is the backward's gradient GEMM).
std::vector<float> gemm_reference(const ScaledMatrix& a, const ScaledMatrix& b);

}  // namespace kiln::ops::fp8

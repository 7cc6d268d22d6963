// The layout of the GPU's bf16 mixed-precision path, and the type its kernels' headers use
// for bf16 data:
//   - the residual stream (block inputs/outputs) and its gradient stay fp32, as under
//     PyTorch autocast (embedding output fp32, fp32 + bf16 -> fp32 adds);
//   - everything a GEMM or attention reads is bf16: norm outputs, q/k/v/o, the MLP's
//     gate|up and hidden, and the compute copies of rank-2 weights;
//   - norm gains, RoPE tables, softmax statistics and every parameter gradient are fp32;
//   - all arithmetic inside a kernel is fp32; only loads and stores are bf16.
// bf16 values cross the kernel headers as their 16 bits (`bf16_bits`, the layout of
// __nv_bfloat16), so host code includes them without CUDA headers. Reductions (norm gain
// gradients, loss rows) use fixed orders: results are bitwise reproducible run to run.
#pragma once

#include <cstdint>

namespace kiln::cuda {

using bf16_bits = uint16_t;

}  // namespace kiln::cuda

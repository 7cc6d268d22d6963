// CUDA kernels behind ops/geglu/geglu.h (geglu_cuda.cu), one templated kernel for both GPU
// paths: `dtype` is f32 (the fp32 path) or bf16 (the mixed path; the values cross this
// header as their 16 bits). Arithmetic is fp32 either way, so bf16 rounds only where data
// is loaded and stored, as the SwiGLU kernels do. The front end validates; these launch on
// the context's stream and trust their inputs.
#pragma once

#include "core/exec_context.h"

#include "core/dtype.h"

#include <cstdint>

namespace kiln::cuda {

// gate_up [n, 2f] (gate | up) -> out [n, f] = gelu_tanh(gate) * up.
void geglu_forward(const ExecContext& ctx, const void* gate_up, DType dtype, int64_t n, int64_t f, void* out);
// dgate_up [n, 2f] from dout [n, f]; out (null: skipped; may alias dout) receives the
// forward's output again, computed as geglu_forward computes it.
void geglu_backward(const ExecContext& ctx, const void* gate_up, const void* dout, DType dtype, int64_t n, int64_t f, void* dgate_up,
                    void* out);

}  // namespace kiln::cuda

// CUDA kernels behind ops/activation/activation.h (activation_cuda.cu), one templated
// kernel for both GPU paths: `dtype` is f32 (the fp32 path) or bf16 (the mixed path; the
// values cross this header as their 16 bits). Arithmetic is fp32 either way, so bf16 rounds
// only where data is loaded and stored. The front end validates; these launch on
// the context's stream and trust their inputs.
#pragma once

#include "core/exec_context.h"

#include "core/dtype.h"
#include "ops/activation/activation_math.h"

#include <cstdint>

namespace kiln::cuda {

// x [count] -> out [count] = act(x).
void activation_forward(const ExecContext& ctx, activation::Kind kind, const void* x, DType dtype, int64_t count, void* out);
// dx = dout * act'(x); out (null: skipped; may alias dout) receives act(x) again.
void activation_backward(const ExecContext& ctx, activation::Kind kind, const void* x, const void* dout, DType dtype, int64_t count, void* dx,
                         void* out);

}  // namespace kiln::cuda

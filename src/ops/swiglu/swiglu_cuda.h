// CUDA kernels behind ops/swiglu/swiglu.h: gate_up [n, 2f] (gate | up) -> out [n, f] =
// silu(gate) * up, and its backward; fp32, or bf16 on the mixed path (fp32 arithmetic).
#pragma once

#include "core/exec_context.h"

#include "ops/mixed_precision.h"

#include <cstdint>

namespace kiln::cuda {

// amax (null: skipped; one device float) receives the largest |value| stored in out
// (forward) or dgate_up (backward).
void swiglu_forward_f32(const ExecContext& ctx, const float* gate_up, int64_t n, int64_t f, float* out, float* amax);
// out (null: skipped; may alias dout) receives the forward's output again.
void swiglu_backward_f32(const ExecContext& ctx, const float* gate_up, const float* dout, int64_t n, int64_t f, float* dgate_up,
                         float* out, float* amax);
void swiglu_forward_bf16(const ExecContext& ctx, const bf16_bits* gate_up, int64_t n, int64_t f, bf16_bits* out,
                         float* amax);
void swiglu_backward_bf16(const ExecContext& ctx, const bf16_bits* gate_up, const bf16_bits* dout, int64_t n, int64_t f,
                          bf16_bits* dgate_up, bf16_bits* out, float* amax);

}  // namespace kiln::cuda

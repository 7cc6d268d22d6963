// Learnable attention sinks on the GPU (docs/attention-sinks.md) as a correction around the
// sink-free kernels (attention_cuda.h's fp32 ones, attention_cudnn.h's bf16 cuDNN SDPA), so
// no kernel needs to know about sinks (cuDNN's own sink needs 9.26 for ragged batches).
//
// A sink s_h is one more logit in each query's softmax with value zero. With O and lse the
// kernel's sink-free output and log-sum-exp of row (i, h):
//   lse' = logaddexp(lse, s_h),  O' = exp(lse - lse') O = sigmoid(lse - s_h) O,
// which the forward writes in place. The backward then runs the sink-free kernel on O' and
// lse': its P = exp(S - lse') are the sink-inclusive probabilities and its
// D = rowsum(dO * O') the sink-inclusive delta, so dq, dk, dv come out right unchanged; the
// sink's own gradient (attention_cpu.cpp's derivation) is
//   d s_h = -sum_i exp(s_h - lse'_i) (dO_i . O'_i),
// which attention_sinks_backward adds to dsinks in a fixed order (no atomics).
//
// lse layout: `lse_seq` 0 for the packed [tokens, q_heads]; S > 0 for cuDNN's head-major
// [tokens / S, q_heads, S] of a uniform batch (attention_cudnn.h). Both launch on the
// context's stream, allocate nothing after a first call and never synchronize (capturable).
#pragma once

#include "core/exec_context.h"

#include <cstdint>

namespace kiln::cuda {

struct SinkArgs {
  int64_t tokens, q_heads, head_dim;
  int64_t lse_seq = 0;  // 0: lse [tokens, q_heads]; S: [tokens / S, q_heads, S]
  bool bf16 = false;    // out and dout are bf16 (else f32); lse, sinks, dsinks are f32
};

// out [tokens, q_heads, head_dim] and lse: O -> O', lse -> lse' in place.
void attention_sinks_forward(const ExecContext& ctx, const SinkArgs& a, void* out, float* lse, const float* sinks);

// dsinks [q_heads] += the sinks' gradient, from the forward's O', lse' and dout.
void attention_sinks_backward(const ExecContext& ctx, const SinkArgs& a, const void* out, const float* lse,
                              const void* dout, const float* sinks, float* dsinks);

}  // namespace kiln::cuda

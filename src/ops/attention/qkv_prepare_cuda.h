// CUDA kernels behind ops/attention/qkv_prepare.h (qkv_prepare_cuda.cu): per-head q/k
// RMSNorm, RoPE and the q|k|v split in one pass, and its backward. They launch on the
// context's stream and trust their inputs; the backward's gain gradients reduce through
// the context's scratch (core/context_scratch.h).
#pragma once

#include "core/exec_context.h"

#include <cstdint>

namespace kiln::cuda {

// On fp32 data, or bf16 data (`bf16`) with fp32 gains and tables. Gains null: no q/k
// norm; cos null: no rotation.
struct QkvPrepareArgs {
  int64_t tokens, q_heads, kv_heads, head_dim;
  const float* q_gain;
  const float* k_gain;
  float eps;
  const int32_t* positions;  // device, [tokens]
  const float* cos;          // [positions, head_dim / 2]
  const float* sin;
  bool bf16;
};
void qkv_prepare_forward(const ExecContext& ctx, const QkvPrepareArgs& a, const void* qkv, void* q, void* k, void* v);
// Gain gradients (+=) in a fixed order; null (or no gains): not computed.
void qkv_prepare_backward(const ExecContext& ctx, const QkvPrepareArgs& a, const void* qkv, const void* dq, const void* dk, const void* dv,
                          void* dqkv, float* q_gain_grad, float* k_gain_grad);

}  // namespace kiln::cuda

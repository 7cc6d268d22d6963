// The fp32 CUDA kernels behind ops/attention/attention.h (attention_cuda.cu: one warp per
// query or key row, exact and deterministic) and the arguments they share with the bf16
// cuDNN path (attention_cudnn.h). They launch on the context's stream and trust their inputs.
#pragma once

#include "core/exec_context.h"

#include <cstdint>

namespace kiln::cuda {

struct AttentionArgs {
  int64_t tokens, q_heads, kv_heads, head_dim, num_seqs;
  const int32_t* cu_seqlens;  // device
  float scale;
  int64_t window;
  float softcap;
  bool deterministic = true;  // false: the cuDNN backward may accumulate dQ with atomics
  // Every sequence holds exactly max_seqlen rows (tokens = num_seqs * max_seqlen): the bf16
  // (cuDNN) path then runs a plain, faster graph. Ignored by the fp32 kernels.
  bool uniform = false;
  // Dropout of the probabilities (AttentionOptions::dropout): the stream key's two words in
  // device memory (null = off), so a captured graph replays with each step's key. The fp32
  // kernels draw dropout::attention_keeps (the CPU's mask); cuDNN seeds Philox from the key
  // and site (attention_cudnn.h).
  const int32_t* dropout_key = nullptr;
  uint32_t dropout_site = 0, dropout_threshold = 0;
  float dropout_p = 0, dropout_scale = 1;
};

// q [tokens, q_heads, head_dim], k/v [tokens, kv_heads, head_dim] -> out like q, lse
// [tokens, q_heads]; the backward writes dq, dk, dv (=).
void attention_forward_f32(const ExecContext& ctx, const AttentionArgs& a, const float* q, const float* k, const float* v, float* out,
                           float* lse);
void attention_backward_f32(const ExecContext& ctx, const AttentionArgs& a, const float* q, const float* k, const float* v, const float* out,
                            const float* lse, const float* dout, float* dq, float* dk, float* dv);

}  // namespace kiln::cuda

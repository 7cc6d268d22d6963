// CPU reference kernels for packed causal GQA attention: each query's whole row of scores
// and its softmax in the forward (attention_math.h), the probabilities recomputed from the
// saved log-sum-exp in the backward.
#pragma once

#include <cstdint>

namespace kiln::cpu {

constexpr int64_t kMaxAttentionHeadDim = 512;

struct AttentionShape {
  int64_t tokens, q_heads, kv_heads, head_dim, num_seqs;
  const int32_t* cu_seqlens;
  double scale;
  int64_t window;
  double softcap;
  // Dropout of the probabilities (AttentionOptions::dropout), on when `dropout`: kept
  // probabilities times dropout_scale = 1 / (1 - p), the mask dropout::attention_keeps.
  bool dropout = false;
  uint64_t dropout_key = 0;
  uint32_t dropout_site = 0, dropout_threshold = 0;
  double dropout_scale = 1;
};

// sinks [q_heads] (or null): each head's sink logit, in every query's denominator.
template <typename T>
void attention_forward(const AttentionShape& s, const T* q, const T* k, const T* v, T* out, T* lse,
                       const T* sinks = nullptr);

// dsinks [q_heads] (with sinks) += the sinks' gradient.
template <typename T>
void attention_backward(const AttentionShape& s, const T* q, const T* k, const T* v, const T* out, const T* lse,
                        const T* dout, T* dq, T* dk, T* dv, const T* sinks = nullptr, T* dsinks = nullptr);

}  // namespace kiln::cpu

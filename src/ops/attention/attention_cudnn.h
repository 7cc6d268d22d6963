// bf16 causal grouped-query attention over packed sequences through the cuDNN frontend's
// SDPA (flash attention), forward and backward. Only for the CUDA build.
//
// Layout (THD, ragged): q [tokens, q_heads, head_dim], k/v [tokens, kv_heads, head_dim],
// out like q, all bf16; sequence s spans rows [cu_seqlens[s], cu_seqlens[s+1]) and never
// attends across its boundaries. lse [tokens, q_heads] fp32: natural-log log-sum-exp of
// each query's scaled scores (the same quantity the fp32 kernels save), written by the
// forward and read by the backward; in a uniform batch (AttentionArgs::uniform) it is
// head-major instead, [num_seqs, q_heads, max_seqlen]. dq/dk/dv are written (=).
// Options: scale, sliding window (AttentionArgs::window, 0 = off), logit softcap
// (AttentionArgs::softcap: cap * tanh(s / cap) of the scaled scores, 0 = off; through cuDNN's
// score modifier, which then carries the masks too).
#pragma once

#include "ops/attention/attention_cuda.h"
#include "ops/mixed_precision.h"

namespace kiln::cuda {

// max_seqlen: the longest sequence of this batch (host value; SeqInfo::max_seqlen).
void attention_forward_bf16(const ExecContext& ctx, const AttentionArgs& a, int64_t max_seqlen, const bf16_bits* q, const bf16_bits* k,
                            const bf16_bits* v, bf16_bits* out, float* lse);
void attention_backward_bf16(const ExecContext& ctx, const AttentionArgs& a, int64_t max_seqlen, const bf16_bits* q, const bf16_bits* k,
                             const bf16_bits* v, const bf16_bits* out, const float* lse, const bf16_bits* dout,
                             bf16_bits* dq, bf16_bits* dk, bf16_bits* dv);

// cuDNN graphs are built per shape bucket: the number of sequences rounded up to a power of
// two and max_seqlen to a power of two (at least 64), the extra sequences empty. Off, the
// exact shape is used (a graph per distinct (num_seqs, max_seqlen)). On by default;
// KILN_CUDNN_BUCKET=0 in the environment turns it off; this setter overrides both.
void set_attention_cudnn_bucketing(bool on);
// cuDNN graphs built so far in this process (forward and backward): tests check reuse.
int64_t attention_cudnn_graph_count();
// Deterministic backward calls whose dP workspace (about B * Hq * S * S * 2 bytes of the
// bucketed shape) exceeded a sixteenth of the GPU's memory and ran the atomic algorithm.
int64_t attention_cudnn_atomic_fallbacks();

}  // namespace kiln::cuda

// Causal grouped-query attention over packed variable-length sequences.
//
// Tokens of several documents are concatenated: q [N, Hq, D], k/v [N, Hkv, D]; sequence
// s spans rows [cu_seqlens[s], cu_seqlens[s+1]). A query attends only to keys of its own
// sequence at or before it, so attention never crosses a document.
#pragma once

#include "core/exec_context.h"
#include "core/tensor.h"
#include "ops/dropout/dropout.h"

namespace kiln::ops {

struct AttentionOptions {
  double scale = 0;     // 0 = 1/sqrt(D)
  int64_t window = 0;   // sliding window: query i sees keys j with i - j < window; 0 = unlimited
  double softcap = 0;   // logits = softcap * tanh(logits / softcap); 0 = off
  // The longest sequence of this batch (a host value, SeqInfo::max_seqlen): the bf16 GPU
  // path (cuDNN) sizes its problem by it; 0 = unknown (fine for the other paths).
  int64_t max_seqlen = 0;
  // false lets the GPU backward accumulate dQ with atomics (cuDNN: faster, not bitwise
  // reproducible run to run); the CPU is deterministic either way.
  bool deterministic = true;
  // Every sequence of the batch holds exactly max_seqlen tokens (SeqInfo::uniform): the bf16
  // GPU path runs cuDNN's plain layout instead of the ragged one, and its lse buffer then
  // holds [sequences, Hq, max_seqlen] (head-major) for the backward of the same batch.
  bool uniform = false;
  // Learnable attention sinks (GPT-OSS): [Hq] logits, one per query head, that join each
  // query's softmax denominator and attend to nothing (their value is zero); the lse then
  // includes them. Undefined = none. lse's dtype; on the GPU a correction around the
  // sink-free kernels (attention_sinks_cuda.h, docs/attention-sinks.md).
  Tensor sinks;
  // Dropout of the softmax probabilities (model.attention_dropout), training only: on when
  // dropout.p > 0 and dropout.key is defined. out = (P * M / (1 - p)) V, M the mask of
  // (key, site, (query token, head), key token) (ops/dropout/dropout_mask.h; site:
  // dropout::attention_site(layer)); lse stays the undropped softmax's, and the backward
  // finds the same mask. CPU and fp32 CUDA draw that hash mask; cuDNN (bf16) draws Philox
  // masks from a seed derived on the device from the key and site (docs/dropout.md).
  DropoutSite dropout;
  bool drops() const { return dropout.p > 0 && dropout.key.defined(); }
};

// out [N, Hq, D] (=), lse [N, Hq] (=, log-sum-exp of each query's scores, for backward).
void attention_forward(const ExecContext& ctx, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_seqlens,
                       const AttentionOptions& options, const Tensor& out, const Tensor& lse);

// dq, dk, dv written with =; dsinks [Hq] (with options.sinks) accumulated with +=, as a
// parameter's gradient.
void attention_backward(const ExecContext& ctx, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                        const Tensor& dout, const Tensor& cu_seqlens, const AttentionOptions& options,
                        const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dsinks = Tensor());

}  // namespace kiln::ops

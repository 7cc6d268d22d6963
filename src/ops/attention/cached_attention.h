// Attention of queries against a KV cache, for incremental decoding (prefill chunks and
// single-token steps alike).
//
// The cache holds, per slot (one sequence each), keys and values by position:
// k_cache/v_cache [S, L, Hkv, D]. A row i of a step belongs to slot slots[i] at position
// positions[i]; it attends to that slot's positions 0..positions[i] inclusive (causal), so
// rows of several sequences, and several rows of one sequence, share one call.
#pragma once

#include "core/exec_context.h"
#include "core/tensor.h"
#include "ops/attention/attention.h"

namespace kiln::ops {

// Writes k/v [N, Hkv, D] of the step's rows into the cache at (slots[i], positions[i]).
void kv_cache_write(const ExecContext& ctx, const Tensor& k, const Tensor& v, const Tensor& slots, const Tensor& positions,
                    const Tensor& k_cache, const Tensor& v_cache);

// q [N, Hq, D] -> out [N, Hq, D] (=). The cache must already hold every position a row sees
// (write the step's own K/V first). Same math as attention_forward: scale 1/sqrt(D) (or
// options.scale), optional sliding window, softcap and sinks ([Hq]: q's dtype on the CPU, f32 on
// the GPU), blocked online softmax.
// On the GPU, q, the cache and out are f32 or all bf16 (fp32 math), and a workspace of
// cached_attention_workspace() f32 elements lets the kernel split each row's positions
// over several blocks (faster for few rows); without one (or on the CPU) it is not used.
void cached_attention_forward(const ExecContext& ctx, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& slots,
                              const Tensor& positions, const AttentionOptions& options, const Tensor& out,
                              const Tensor& workspace = Tensor());

// f32 elements of the GPU workspace for `rows` rows against a cache of max_len positions
// (0 when the kernel would not split); depends on shapes only.
int64_t cached_attention_workspace(int64_t rows, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                                   int64_t max_len);

}  // namespace kiln::ops

// One step of the KDA delta rule for decode rows (nn/kda_mixer_decode.cpp): row i continues
// the state of its sequence's slot slots[i] by one token, as kda_recurrent_forward (kda.h)
// does token by token:
//   S = (I - beta k k^T) Diag(exp(g)) S + beta k v^T,   o = scale S^T q   (scale 0 = 1/sqrt(d_k))
// q, k, g [n, H, d_k], v, out [n, H, d_v], beta [n, H]; slots i32 [n] on q's device; the
// states [slots, H, d_k, d_v] are updated in place. Rows of one slot (a prefill chunk) come
// in position order and run in that order.
//
// CPU: f32 or f64, the states of q's dtype (the recurrent oracle, one row at a time; slots
// are checked). GPU (ops/kda/kda_decode_cuda.h): q.. f32 or bf16 (fp32 math), the states
// fp32, slots trusted (not read back); `distinct_slots` (every row another slot) lets the
// rows run in parallel. No allocation, no synchronization: capturable.
#pragma once

#include "core/exec_context.h"
#include "core/tensor.h"
#include "ops/kda/kda.h"

namespace kiln::ops {

void kda_decode_step(const ExecContext& ctx, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                     const Tensor& beta, const Tensor& slots, bool distinct_slots, const KdaOptions& options,
                     const Tensor& states, const Tensor& out);

}  // namespace kiln::ops

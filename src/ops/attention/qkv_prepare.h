// Attention inputs from the fused q|k|v projection, one head at a time: q and k through an
// optional RMSNorm (one gain over the head dimension, shared by the heads: Qwen3's q_norm /
// k_norm) and an optional rotary embedding (RoPE, rotate_half pairing (j, j + D/2)), v
// copied out. One pass instead of a split, two norms and two rotations; the backward
// recomputes the norm statistics from the raw projection, so attention saves only that
// projection (not raw and normed copies of q and k).
#pragma once

#include "core/exec_context.h"
#include "core/tensor.h"

namespace kiln::ops {

struct QkvPrepare {
  int64_t q_heads = 0, kv_heads = 0, head_dim = 0;
  Tensor q_gain, k_gain;  // [head_dim], parameter dtype (f32 on the mixed path); undefined: no norm
  double eps = 1e-6;
  Tensor positions;       // i32 [T]: each token's position in its own sequence
  Tensor cos, sin;        // [max_positions, head_dim / 2], parameter dtype; undefined: no rotation
};

// qkv [T, (Hq + 2 Hkv) D] -> q [T, Hq, D], k and v [T, Hkv, D] (=).
void qkv_prepare_forward(const ExecContext& ctx, const Tensor& qkv, const QkvPrepare& p, const Tensor& q, const Tensor& k, const Tensor& v);

// dq, dk (gradients of forward's q and k) and dv -> dqkv [T, (Hq + 2 Hkv) D] (=); the gain
// gradients are accumulated (+=) when given (both or neither) and the norm has gains.
void qkv_prepare_backward(const ExecContext& ctx, const Tensor& qkv, const QkvPrepare& p, const Tensor& dq, const Tensor& dk,
                          const Tensor& dv, const Tensor& dqkv, const Tensor& dq_gain, const Tensor& dk_gain);

}  // namespace kiln::ops

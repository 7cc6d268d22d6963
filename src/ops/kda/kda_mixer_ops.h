// The per-token pieces of the KDA token mixer (nn/kda_mixer.h) around the delta rule:
//   split_norm   the convolved q|k|v row [N, 2 H d_k + H d_v] -> q, k [N, H, d_k] each
//                L2-normalized per head (x / sqrt(|x|^2 + eps), FLA's l2norm, eps 1e-6)
//                and v [N, H, d_v] as it is
//   beta         sigmoid of the beta projection [N, H]
//   output_gate  y = RMSNorm_head(o) * gain * sigmoid(gate): o [N, H, d_v], gain [d_v]
//                (shared by the heads, as FLA's FusedRMSNormGated), gate and y [N, H d_v]
// Backwards recompute from their inputs (nothing saved); parameter gradients accumulate.
// CPU: f32, f64. GPU (kda_mixer_cuda.h): activations f32 or bf16 (fp32 math), gain and
// dgain fp32; dgain summed in a fixed order (the same bits every run).
#pragma once

#include "core/exec_context.h"
#include "core/tensor.h"

namespace kiln::ops {

inline constexpr double kKdaL2NormEps = 1e-6;

void kda_split_norm_forward(const ExecContext& ctx, const Tensor& qkv, const Tensor& q, const Tensor& k,
                            const Tensor& v);
// dq, dk, dv -> dqkv (=).
void kda_split_norm_backward(const ExecContext& ctx, const Tensor& qkv, const Tensor& dq, const Tensor& dk,
                             const Tensor& dv, const Tensor& dqkv);

void kda_beta_forward(const ExecContext& ctx, const Tensor& raw, const Tensor& beta);
void kda_beta_backward(const ExecContext& ctx, const Tensor& raw, const Tensor& dbeta, const Tensor& draw);

void kda_output_gate_forward(const ExecContext& ctx, const Tensor& o, const Tensor& gain, const Tensor& gate,
                             double eps, const Tensor& y);
// From dy: d_o (=), dgate (=), dgain (+=).
void kda_output_gate_backward(const ExecContext& ctx, const Tensor& o, const Tensor& gain, const Tensor& gate,
                              double eps, const Tensor& dy, const Tensor& d_o, const Tensor& dgate,
                              const Tensor& dgain);

}  // namespace kiln::ops

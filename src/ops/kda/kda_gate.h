// KDA's channel-wise log decay from its gate projection, as Kimi Linear's (and
// flash-linear-attention's fused_kda_gate):
//   g[t, h, i] = -exp(A_log[h]) * softplus(raw[t, h, i] + dt_bias[h, i])
// so the per-token decay a = exp(g) lies in (0, 1): A_log sets each head's time scale,
// dt_bias each channel's. softplus(x) = log(1 + e^x), in its overflow-free form.
//
// On the GPU raw, g, dg and draw are f32 or bf16 (fp32 math), A_log, dt_bias and their
// gradients f32; the parameter gradients are summed in a fixed order (same bits every run).
#pragma once

#include "core/exec_context.h"
#include "core/tensor.h"

namespace kiln::ops {

// raw [N, H, d_k], A_log [H], dt_bias [H, d_k] (undefined: zero) -> g [N, H, d_k] (=).
void kda_gate_forward(const ExecContext& ctx, const Tensor& raw, const Tensor& A_log, const Tensor& dt_bias,
                      const Tensor& g);

// From dg: draw (=), dA_log += and ddt_bias += (parameter gradients accumulate; each
// skipped if undefined).
void kda_gate_backward(const ExecContext& ctx, const Tensor& raw, const Tensor& A_log, const Tensor& dt_bias,
                       const Tensor& dg, const Tensor& draw, const Tensor& dA_log, const Tensor& ddt_bias);

}  // namespace kiln::ops

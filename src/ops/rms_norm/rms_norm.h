// RMSNorm over the last dimension: y = x / sqrt(mean(x^2) + eps) * w, in fp32 or wider.
// Also serves per-head q/k norms: view [tokens, heads, head_dim] as [tokens*heads, head_dim].
#pragma once

#include "core/exec_context.h"
#include "core/tensor.h"

namespace kiln::ops {

// x [R, C], w [C] (undefined = no gain) -> y [R, C], rstd [R] (saved for backward).
void rms_norm_forward(const ExecContext& ctx, const Tensor& x, const Tensor& w, double eps, const Tensor& y, const Tensor& rstd);

// The pre-norm residual step in one pass where a fused kernel exists (the GPU's mixed
// path): sum = a + b (sum like a; b the branch output, like y), then y = rms_norm(sum).
// Elsewhere the two ops run one after the other. sum must not alias a or b.
void add_rms_norm_forward(const ExecContext& ctx, const Tensor& a, const Tensor& b, const Tensor& w, double eps, const Tensor& sum,
                          const Tensor& y, const Tensor& rstd);

// dx [R, C]: = (or += when accumulate_dx). dw [C]: +=, skipped if undefined. dx_copy (if
// defined, [R, C] in its own dtype) receives dx's final values too: on the GPU's mixed path
// the bf16 copy of the fp32 residual gradient that the next branch reads, written by the
// same pass instead of a second one over dx.
void rms_norm_backward(const ExecContext& ctx, const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy, const Tensor& dx,
                       const Tensor& dw, bool accumulate_dx = false, const Tensor& dx_copy = Tensor());

}  // namespace kiln::ops

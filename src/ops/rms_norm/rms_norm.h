// RMSNorm over the last dimension: y = x / sqrt(mean(x^2) + eps) * w, in fp32 or wider.
// Also serves per-head q/k norms: view [tokens, heads, head_dim] as [tokens*heads, head_dim].
#pragma once

#include "core/tensor.h"

namespace kiln::ops {

// x [R, C], w [C] (undefined = no gain) -> y [R, C], rstd [R] (saved for backward).
void rms_norm_forward(const Tensor& x, const Tensor& w, double eps, const Tensor& y, const Tensor& rstd);

// dx [R, C]: = (or += when accumulate_dx). dw [C]: +=, skipped if undefined.
void rms_norm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy, const Tensor& dx,
                       const Tensor& dw, bool accumulate_dx = false);

}  // namespace kiln::ops

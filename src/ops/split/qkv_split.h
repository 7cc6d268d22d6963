// Splitting the fused q|k|v projection output into per-head tensors, and its backward.
#pragma once

#include "core/exec_context.h"
#include "core/tensor.h"

namespace kiln::ops {

// qkv [N, (Hq + 2 Hkv) D] -> q [N, Hq, D], k [N, Hkv, D], v [N, Hkv, D] (=).
void qkv_split(const ExecContext& ctx, const Tensor& qkv, const Tensor& q, const Tensor& k, const Tensor& v);
// The inverse: dq, dk, dv -> dqkv (=).
void qkv_merge(const ExecContext& ctx, const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dqkv);

}  // namespace kiln::ops

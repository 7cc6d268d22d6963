// Pointwise activations of the ungated MLPs (ops/activation/activation_math.h):
// out = act(x) elementwise, and its backward. Both keep nothing: the MLP saves the
// pre-activation and the backward rebuilds act(x) for the down projection's weight gradient.
#pragma once

#include "core/exec_context.h"
#include "core/tensor.h"
#include "ops/activation/activation_math.h"

namespace kiln::ops {

// x [N, F] -> out [N, F] (=), same dtype and device (f32 or bf16 on the GPU).
void activation_forward(const ExecContext& ctx, activation::Kind kind, const Tensor& x, const Tensor& out);
// dx [N, F] (=) = dout * act'(x). When `out` is given it receives act(x) again (=), as the
// forward computes it; it may be dout itself (each element is read before it is written).
void activation_backward(const ExecContext& ctx, activation::Kind kind, const Tensor& x, const Tensor& dout, const Tensor& dx,
                         const Tensor& out = Tensor());

}  // namespace kiln::ops

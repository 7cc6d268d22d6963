// SwiGLU activation on a fused gate|up projection: out = silu(gate) * up.
#pragma once

#include "core/exec_context.h"
#include "core/tensor.h"

namespace kiln::ops {

// gate_up [N, 2F] holds gate in columns [0, F) and up in [F, 2F) -> out [N, F] (=).
void swiglu_forward(const ExecContext& ctx, const Tensor& gate_up, const Tensor& out);
// dgate_up [N, 2F] (=) from dout [N, F]. When `out` is given it receives the forward's
// output again (=), so the MLP need not save it; it may be dout itself (each element is
// read before it is overwritten).
void swiglu_backward(const ExecContext& ctx, const Tensor& gate_up, const Tensor& dout, const Tensor& dgate_up, const Tensor& out = Tensor());

}  // namespace kiln::ops

// SwiGLU activation on a fused gate|up projection: out = silu(gate) * up.
#pragma once

#include "core/exec_context.h"
#include "core/tensor.h"

namespace kiln::ops {

// gate_up [N, 2F] holds gate in columns [0, F) and up in [F, 2F) -> out [N, F] (=).
// `amax` (f32 [1] on the same device, or undefined) receives max |out| as stored: the
// scale an FP8 quantize of out needs, without reading out again (ops/fp8/fp8_linear.h).
void swiglu_forward(const ExecContext& ctx, const Tensor& gate_up, const Tensor& out, const Tensor& amax = Tensor());
// dgate_up [N, 2F] (=) from dout [N, F]. When `out` is given it receives the forward's
// output again (=), so the MLP need not save it; it may be dout itself (each element is
// read before it is overwritten). `amax` as the forward's, of dgate_up.
void swiglu_backward(const ExecContext& ctx, const Tensor& gate_up, const Tensor& dout, const Tensor& dgate_up,
                     const Tensor& out = Tensor(), const Tensor& amax = Tensor());

}  // namespace kiln::ops

// SwiGLU activation on a fused gate|up projection: out = silu(gate) * up.
#pragma once

#include "core/tensor.h"

namespace kiln::ops {

// gate_up [N, 2F] holds gate in columns [0, F) and up in [F, 2F) -> out [N, F] (=).
void swiglu_forward(const Tensor& gate_up, const Tensor& out);
// dgate_up [N, 2F] (=) from dout [N, F].
void swiglu_backward(const Tensor& gate_up, const Tensor& dout, const Tensor& dgate_up);

}  // namespace kiln::ops

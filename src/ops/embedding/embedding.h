// Token embedding lookup.
#pragma once

#include "core/tensor.h"

namespace kiln::ops {

// tokens i32 [N], table [V, d] -> out [N, d] (=). Throws on a token id outside [0, V).
void embedding_forward(const Tensor& tokens, const Tensor& table, const Tensor& out);
// dtable [V, d] += scatter of dout [N, d] by token.
void embedding_backward(const Tensor& tokens, const Tensor& dout, const Tensor& dtable);

}  // namespace kiln::ops

// Dynamic Tanh (DyT, Zhu et al. 2025, "Transformers without Normalization"), a drop-in for
// a norm layer with no statistics:
//   y = tanh(alpha x) * w + b,
// alpha one learnable scalar per norm, w and b per feature. On the CPU every tensor has x's
// dtype (f32 or f64). On the GPU the parameters and their gradients are f32; x is f32 (the
// residual stream) or, on the mixed path, bf16 (the per-head q/k norm); y and dy are bf16 on
// the mixed path, else f32; dx has x's dtype. All arithmetic is fp32 or wider.
#pragma once

#include "core/exec_context.h"
#include "core/tensor.h"

namespace kiln::ops {

// x [R, C], alpha [1], w [C] and b [C] (each optional: undefined w is ones, b zeros) -> y [R, C] (=).
void dyt_forward(const ExecContext& ctx, const Tensor& x, const Tensor& alpha, const Tensor& w, const Tensor& b, const Tensor& y);

// From the forward's x and dy [R, C]:
//   dx [R, C] = (or += when accumulate_dx) dy w alpha (1 - t^2),  t = tanh(alpha x);
//   dalpha [1] += sum dy w x (1 - t^2);  dw [C] += sum over rows of dy t;  db [C] += sum of dy.
// The gradients are each skipped if undefined; on the GPU they are summed in an order fixed
// by the shape (no atomics), so a backward gives the same bits every run. dx_copy (if
// defined, [R, C]) receives dx's final values too (the mixed path's bf16 copy of the
// residual gradient, written in the same pass).
void dyt_backward(const ExecContext& ctx, const Tensor& x, const Tensor& alpha, const Tensor& w, const Tensor& dy, const Tensor& dx,
                  const Tensor& dalpha, const Tensor& dw, const Tensor& db, bool accumulate_dx = false,
                  const Tensor& dx_copy = Tensor());

}  // namespace kiln::ops

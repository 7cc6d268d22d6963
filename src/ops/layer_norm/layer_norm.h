// LayerNorm over the last dimension, as torch.nn.functional.layer_norm:
//   y = (x - mean) * rstd * w + b,   rstd = 1 / sqrt(var + eps),
// mean and the biased variance var over the row's C columns, in fp32 or wider (f64 in the
// f64 path). The gain w and the bias b are each optional (undefined: ones / zeros).
#pragma once

#include "core/exec_context.h"
#include "core/tensor.h"

namespace kiln::ops {

// x [R, C], w [C], b [C] -> y [R, C]; mean [R] and rstd [R] are saved for backward.
void layer_norm_forward(const ExecContext& ctx, const Tensor& x, const Tensor& w, const Tensor& b, double eps, const Tensor& y,
                        const Tensor& mean, const Tensor& rstd);

// The pre-norm residual step: sum = a + branch (sum like a; branch the branch output, like
// y), then y = layer_norm(sum). One pass on the GPU; on the CPU the two ops in turn. sum
// must not alias a or branch.
void add_layer_norm_forward(const ExecContext& ctx, const Tensor& a, const Tensor& branch, const Tensor& w, const Tensor& b, double eps,
                            const Tensor& sum, const Tensor& y, const Tensor& mean, const Tensor& rstd);

// From the forward's x, mean and rstd and dy [R, C]:
//   dx [R, C] = (or += when accumulate_dx); dw [C] +=, db [C] += (each skipped if undefined).
// dx_copy (if defined, [R, C]) receives dx's final values too: on the GPU's mixed path the
// bf16 copy of the fp32 residual gradient, written by the same pass.
void layer_norm_backward(const ExecContext& ctx, const Tensor& x, const Tensor& w, const Tensor& mean, const Tensor& rstd, const Tensor& dy,
                         const Tensor& dx, const Tensor& dw, const Tensor& db, bool accumulate_dx = false,
                         const Tensor& dx_copy = Tensor());

}  // namespace kiln::ops

// Rotary position embedding, HF "rotate_half" convention: dimension j pairs with j + D/2.
#pragma once

#include "core/exec_context.h"
#include "core/tensor.h"

#include <vector>

namespace kiln::ops {

// Inverse frequencies as transformers computes them (fp32): 1 / theta^(2j / D), j < D/2.
std::vector<float> rope_inverse_frequencies(double theta, int64_t head_dim);

// Fills cos/sin tables [max_positions, D/2] from inverse frequencies; the angle is formed
// in fp32 as transformers does (pos * inv_freq) so exported models match exactly. Both
// tables are multiplied by `scale` (YaRN's attention factor), in fp32 for fp32 tables.
// Columns past inv_freq's D'/2 <= D/2 hold cos 1 and sin 0 (unscaled): partial rotary,
// their pairs pass unrotated.
void rope_fill_tables(const ExecContext& ctx, const std::vector<float>& inv_freq, const Tensor& cos, const Tensor& sin, float scale = 1.0f);

// In place on x [N, H, D]: rotates each head of token i by positions[i] (i32 [N]).
// inverse = true applies the transposed rotation, which is the backward pass.
void rope_apply(const ExecContext& ctx, const Tensor& x, const Tensor& positions, const Tensor& cos, const Tensor& sin, bool inverse);

}  // namespace kiln::ops

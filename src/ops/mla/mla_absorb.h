// The absorbed products of MLA decode (nn/mla_mixer_decode.cpp): the cache holds the latent
// c [r] per position, never k and v, and the key and value up-projections move to the
// query and output sides. With W_kb,h [d_qk, r] and W_vb,h [d_v, r] head h's rows of the
// up-projections:
//   absorb_query   q'_h = W_kb,h^T q_h   q [N, H, d_qk] -> q' [N, H, r]    (q'.c = q.k)
//   expand_values  o_h  = W_vb,h cbar_h  cbar [N, H, r] -> o [N, H, d_v]   (cbar = sum_t p_t c_t)
// w_kb is [H d_qk, r], w_vb [H d_v, r] (row views of the fused k_b|v_b weight). Outputs
// are written with =. CPU (f32, f64) and CUDA (f32, bf16 with fp32 accumulation:
// mla_absorb_cuda.h).
#pragma once

#include "core/exec_context.h"
#include "core/tensor.h"

namespace kiln::ops {

void mla_absorb_query(const ExecContext& ctx, const Tensor& q, const Tensor& w_kb, const Tensor& q_abs);
void mla_expand_values(const ExecContext& ctx, const Tensor& cbar, const Tensor& w_vb, const Tensor& o);

}  // namespace kiln::ops

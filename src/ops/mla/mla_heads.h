// Per-head width changes for the NoPE MLA token mixer (nn/mla_mixer.h): its queries and
// keys are d_qk wide, its values d_v, while the attention op takes q, k and v of one head
// width D. The mixer pads all three to D = max(d_qk, d_v) with zeros (a zero column adds
// nothing to q.k, and a zero value column yields a zero output column, which is dropped),
// and crops the gradients back.
//   copy_heads   src [N, H, a] -> dst [N, H, b]: the first min(a, b) columns of each head,
//                the rest of dst zero. Padding (b > a), cropping (b < a) or a plain copy.
// CPU (f32, f64) and CUDA (f32, bf16: mla_heads_cuda.h, bits moved, nothing converted).
#pragma once

#include "core/exec_context.h"
#include "core/tensor.h"

namespace kiln::ops {

void mla_copy_heads(const ExecContext& ctx, const Tensor& src, const Tensor& dst);

}  // namespace kiln::ops

// Block Attention Residuals' mix over depth (Kimi Team, "Attention Residuals", 2026;
// docs/attn-res.md). For each row t, over the sources s = 0 .. S-1 (each [T, C]):
//   k_s = V_s / sqrt(mean_c V_s^2 + eps)     an RMSNorm without a gain
//   a   = softmax_s(w . k_s)                 w [C]: the reading sublayer's pseudo-query
//   out = sum_s a_s V_s
// The sources mix per row: positions never meet (a mix over depth, not over the sequence).
//
// CPU: f32, f64. CUDA: f32 (attn_res_cuda.h; on the mixed path the stream the mix reads
// and writes is fp32 too).
#pragma once

#include "core/exec_context.h"
#include "core/tensor.h"

#include <span>

namespace kiln::ops {

// The most sources one mix reads on the GPU (the kernel passes their addresses by value).
constexpr int kAttnResGpuMaxSources = 32;

void attn_res_mix_forward(const ExecContext& ctx, std::span<const Tensor> sources, const Tensor& query, double eps,
                          const Tensor& out);

// From dout [T, C]: dsources[s] += dL/dV_s (through the weights a_s and through the scores),
// dquery += dL/dw. The weights are recomputed from the sources. dsources must be distinct
// tensors, none of them a source.
void attn_res_mix_backward(const ExecContext& ctx, std::span<const Tensor> sources, const Tensor& query, double eps,
                           const Tensor& dout, std::span<const Tensor> dsources, const Tensor& dquery);

}  // namespace kiln::ops

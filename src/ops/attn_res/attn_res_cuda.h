// CUDA kernels behind ops/attn_res/attn_res.h (attn_res_cuda.cu): Block Attention
// Residuals' softmax mix over depth, fp32 only. On the mixed path too every tensor the mix
// reads or writes is fp32: the sources are the embedding and the block sums (the fp32
// stream), the mix's output is a sublayer's wide input, the query a rank-1 master; the bf16
// branch outputs are converted into the sums before (nn/attn_res.cpp). The front end
// validates; these trust their inputs. Both launch on the context's stream only (the
// query's gradient goes through the context's scratch, core/context_scratch.h), so a
// captured step may call them.
#pragma once

#include "core/exec_context.h"
#include "ops/attn_res/attn_res.h"

#include <cstdint>

namespace kiln::cuda {

// The most sources one mix reads (the embedding, the completed blocks, the partial sum).
constexpr int kAttnResMaxSources = ops::kAttnResGpuMaxSources;

// out [rows, cols] = sum_s a_s V_s, a = softmax_s(w . V_s / rms(V_s)); sources: n pointers
// (held on the host, passed by value to the kernel).
void attn_res_mix_forward(const ExecContext& ctx, const float* const* sources, int n, const float* query, float eps,
                          int64_t rows, int64_t cols, float* out);

// dsources[s] += dL/dV_s, dquery += dL/dw (summed over rows through per-block partials
// added in a fixed order: the same bits every run).
void attn_res_mix_backward(const ExecContext& ctx, const float* const* sources, int n, const float* query, float eps,
                           const float* dout, int64_t rows, int64_t cols, float* const* dsources, float* dquery);

}  // namespace kiln::cuda

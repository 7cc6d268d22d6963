// CUDA kernels of the KDA mixer's decode step (kda_decode_cuda.cu), behind
// ops::short_conv_step (ops/short_conv/short_conv.h) and ops::kda_decode_step
// (ops/kda/kda_decode.h). A step's rows each continue the fixed-size state of their slot;
// rows of one slot (a prefill chunk) are in position order and run in that order.
//
// Activations of `dtype` (f32 or bf16: bf16 read, fp32 math, results stored in dtype);
// slots i32 [n] on the device, trusted. Everything launches on cuda::stream(ctx) and
// neither allocates nor synchronizes: a decode step with these kernels can be captured.
#pragma once

#include "core/dtype.h"
#include "core/exec_context.h"
#include "ops/kda/kda_cuda.h"

#include <cstdint>

namespace kiln::cuda {

// x, y [n, ch], w [ch, kernel], state [slots, kernel - 1, ch], all of dtype: y = silu(conv)
// over the slot's last kernel - 1 inputs and x; the state then holds the newest of them.
void short_conv_step(const ExecContext& ctx, DType dtype, const void* x, const void* w, const int32_t* slots,
                     int64_t n, int64_t ch, int64_t kernel, void* state, void* y);

// The delta rule's step for rows q, k, g [n, H, d_k], v, out [n, H, d_v], beta [n, H] (of
// a.dtype; a.tokens = n, a.cu_seqlens unused) on states [slots, H, d_k, d_v] fp32, each
// row on its slot's state, in place. distinct_slots: every row a different slot, so rows
// run in parallel; otherwise each block walks all rows in order. d_k <= 256.
void kda_decode_step(const ExecContext& ctx, const KdaArgs& a, const void* q, const void* k, const void* v,
                     const void* g, const void* beta, const int32_t* slots, bool distinct_slots, float* states,
                     void* out);

}  // namespace kiln::cuda

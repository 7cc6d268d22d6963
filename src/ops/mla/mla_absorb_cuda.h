// CUDA kernels behind ops/mla/mla_absorb.h (mla_absorb_cuda.cu): the absorbed products of
// MLA decode on the device. One block per (row, head); the head's small vector is read
// once into shared memory as fp32, every product accumulates in fp32, and the output is
// rounded once to the dtype (f32, or bf16 on the mixed path: inputs, weights and outputs
// all share it). Only enqueues on the context's stream (capturable in a CUDA graph).
#pragma once

#include "core/dtype.h"
#include "core/exec_context.h"

#include <cstdint>

namespace kiln::cuda {

// q [rows, heads, d] and w_kb [heads d, r] -> q_abs [rows, heads, r]:
// q_abs[n, h, a] = sum_i q[n, h, i] w_kb[h d + i, a].
void mla_absorb_query(const ExecContext& ctx, DType dtype, const void* q, int64_t rows, int64_t heads, int64_t d,
                      const void* w_kb, int64_t r, void* q_abs);

// cbar [rows, heads, r] and w_vb [heads d, r] -> o [rows, heads, d]:
// o[n, h, j] = sum_a w_vb[h d + j, a] cbar[n, h, a].
void mla_expand_values(const ExecContext& ctx, DType dtype, const void* cbar, int64_t rows, int64_t heads, int64_t r,
                       const void* w_vb, int64_t d, void* o);

}  // namespace kiln::cuda

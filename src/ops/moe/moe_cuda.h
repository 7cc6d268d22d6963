// CUDA kernels behind ops/moe/moe.h's dispatch, gather and combine (moe_cuda.cu); the
// grouped products are grouped_gemm_cuda.h. The sizes of the grouped layout (counts,
// offsets) stay in device memory: nothing here reads them on the host or synchronizes,
// so a step with experts can be captured as a CUDA graph.
//
// Every kernel is deterministic: the dispatch gives the CPU reference's stable order (rows
// of an expert in pair order) whatever the thread schedule, and every sum runs in a fixed
// order (a token's k rows in choice order; a row dot product in a butterfly fixed by the
// width). No atomics on floats. Token rows (y, out, dout, dy, x, dx, grouped) are of
// `dtype` (f32, or bf16 on the mixed path); routing weights and their gradient are fp32.
// The front end validates shapes and dtypes; the row kernels launch on the context's
// stream, the dispatch too (its chunk counts in the context's scratch). They trust their
// inputs (an expert id outside [0, E) traps). No output may alias an input.
#pragma once

#include "core/dtype.h"
#include "core/exec_context.h"

#include <cstdint>

namespace kiln::cuda {

// experts i32 [pairs] (pairs = tokens x k, pair p = t k + j; -1: an empty slot) -> counts
// [E] (routed), offsets [E + 1] (kept: at most `capacity` per expert, 0 = all, the first
// in pair order), pair_of_row [rows], row_of_pair [pairs] (-1: empty or dropped), and
// *dropped += the pairs past a capacity (dropped null: not counted). More live rows than
// `rows` trap.
void moe_dispatch(const ExecContext& ctx, const int32_t* experts, int64_t pairs, int64_t e_count, int64_t capacity, int64_t rows,
                  int32_t* counts, int32_t* offsets, int32_t* pair_of_row, int32_t* row_of_pair, int32_t* dropped);

// grouped [rows, cols] = x[pair_of_row[r] / k] for the *live rows (offsets[E], on the
// device) first rows, zero after.
void moe_gather(const ExecContext& ctx, const void* x, DType dtype, int64_t rows, int64_t cols, int64_t k, const int32_t* pair_of_row,
                const int32_t* live, void* grouped);
// dx [tokens, cols] (= or +=) the sum of each token's kept rows of dgrouped, in slot order.
void moe_gather_backward(const ExecContext& ctx, const void* dgrouped, DType dtype, int64_t tokens, int64_t cols, int64_t k,
                         const int32_t* row_of_pair, void* dx, bool accumulate);

// out [tokens, cols] = sum_j weights[t, j] y[row_of_pair[t k + j]] over the kept pairs
// (fp32 sums in slot order).
void moe_combine(const ExecContext& ctx, const void* y, DType dtype, const float* weights, int64_t tokens, int64_t cols, int64_t k,
                 const int32_t* row_of_pair, void* out);
// dy's live rows = weights x dout (row by row), dweights [tokens, k] = dout . y (fp32; 0
// for an empty or dropped pair).
void moe_combine_backward(const ExecContext& ctx, const void* y, DType dtype, const float* weights, const void* dout, int64_t tokens,
                          int64_t cols, int64_t k, const int32_t* row_of_pair, void* dy, float* dweights);

// ops::moe_swiglu_backward on `rows` grouped rows of width f (gate_up [rows, 2f]): the
// *live first rows from pair_of_row's weights, the rest zero; dweights [pairs] zeroed
// first, then written for the live rows' pairs. weighted_act may alias du.
void moe_swiglu_backward(const ExecContext& ctx, const void* gate_up, const void* du, DType dtype, const float* weights,
                         int64_t rows, int64_t f, int64_t pairs, const int32_t* pair_of_row, const int32_t* live,
                         void* dgate_up, void* weighted_act, float* dweights);

}  // namespace kiln::cuda

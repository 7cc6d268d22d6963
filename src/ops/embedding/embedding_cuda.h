// CUDA kernels behind ops/embedding/embedding.h (embedding_cuda.cu), fp32 tables. They
// launch on the context's stream and trust their inputs.
#pragma once

#include "core/exec_context.h"

#include <cstdint>

namespace kiln::cuda {

// out [n, dim] = table rows of tokens [n].
void embedding_forward_f32(const ExecContext& ctx, const int32_t* tokens, const float* table, int64_t n, int64_t dim, float* out);
// The same from a bf16 table (its bit patterns; bf16 masters, optim.master_weights) into fp32 rows.
void embedding_forward_bf16_table(const ExecContext& ctx, const int32_t* tokens, const uint16_t* table, int64_t n,
                                  int64_t dim, float* out);
// Accumulates with atomics: fast, but the order of repeated ids is not fixed.
void embedding_backward_f32(const ExecContext& ctx, const int32_t* tokens, const float* dout, int64_t n, int64_t dim, float* dtable);
// One block per group of equal ids: each table row's gradient summed in a fixed order.
void embedding_backward_grouped_f32(const ExecContext& ctx, const int32_t* order, const int32_t* group_tokens, const int32_t* group_starts,
                                    int64_t groups, const float* dout, int64_t dim, float* dtable);

}  // namespace kiln::cuda

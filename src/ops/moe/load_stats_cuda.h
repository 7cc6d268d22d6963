// CUDA kernels behind ops/moe/load_stats.h (load_stats_cuda.cu). Integer counts, and an
// entropy sum over fixed blocks added in a fixed order: the same bits every run. They launch on
// the context's stream and trust the front end.
#pragma once

#include "core/exec_context.h"

#include <cstdint>

namespace kiln::cuda {

// total [n] += counts [n].
void add_counts(const ExecContext& ctx, const int32_t* counts, int64_t n, int32_t* total);
// sums[0] += sum_t -sum_j p log p over probs [tokens, e_count] (fp32), sums[1] += tokens.
void routing_entropy_sum(const ExecContext& ctx, const float* probs, int64_t tokens, int64_t e_count, double* sums);
// last [n] = counts [n], counts = 0.
void take_counts(const ExecContext& ctx, int32_t* counts, int64_t n, int32_t* last);
// As ops::moe_end_step.
void moe_end_step(const ExecContext& ctx, int32_t* counts, double* entropy, int32_t* last_counts, double* last_entropy, int32_t* dead_steps,
                  int64_t e_count);

}  // namespace kiln::cuda

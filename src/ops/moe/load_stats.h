// The sparse layers' load diagnostics over a training step (nn/moe/moe_mlp.h reports them):
// the routed choices per expert, the routing entropy, the runs of steps an expert has gone
// without a token. They live where the model lives and are written by kernels on the GPU
// (load_stats_cuda.h), so a captured step adds to them without a host read; only
// moe_load_report reads them back, at log steps.
#pragma once

#include "core/exec_context.h"
#include "core/tensor.h"

namespace kiln::ops {

// total i32 [E] += counts i32 [E] (a micro-batch's routed choices, summed over the step).
void moe_accumulate_counts(const ExecContext& ctx, const Tensor& counts, const Tensor& total);

// sums f64 [2] += (sum over the rows of probs [T, E] (wide) of -sum_j p_j log p_j, T):
// each token's routing entropy and the tokens, summed in a fixed order.
void routing_entropy_sum(const ExecContext& ctx, const Tensor& probs, const Tensor& sums);

// The end of a step: dead_steps[e] = counts[e] == 0 ? dead_steps[e] + 1 : 0, then
// last_counts = counts and last_entropy = entropy, and counts and entropy are zeroed for the
// next step (counts, last_counts, dead_steps i32 [E]; entropy, last_entropy f64 [2]).
void moe_end_step(const ExecContext& ctx, const Tensor& counts, const Tensor& entropy, const Tensor& last_counts, const Tensor& last_entropy,
                  const Tensor& dead_steps);

// The end of a step for a counter (the capacity's dropped pairs, i32 [n]): last = counts,
// counts = 0.
void moe_take_counts(const ExecContext& ctx, const Tensor& counts, const Tensor& last);
// A counter's first value on the host (i32; a synchronization on the GPU).
int64_t moe_read_count(const ExecContext& ctx, const Tensor& counts);

// The last step's load, relative to the mean count: min, max and the coefficient of
// variation; experts without a token and the longest run of such steps; the mean routing
// entropy per token. Reads the tensors to the host (a synchronization on the GPU).
struct MoeLoadReport {
  double min = 0, max = 0, cv = 0;
  int64_t dead = 0, dead_steps_max = 0;
  double entropy = 0;
  double routed = 0;  // the step's routed pairs (the counts' sum)
};
MoeLoadReport moe_load_report(const ExecContext& ctx, const Tensor& last_counts, const Tensor& last_entropy, const Tensor& dead_steps);

}  // namespace kiln::ops

// The load diagnostics' kernels (load_stats_cuda.h).
#include "ops/moe/load_stats_cuda.h"

#include "core/context_scratch.h"
#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "ops/block_reduce.cuh"
#include "ops/grid_stride.cuh"

namespace kiln::cuda {

namespace {

constexpr int kThreads = 256;
// The entropy sum: kEntropyBlocks blocks of kThreads, one partial each, then one block adds
// the partials in block order (the same bits every run; no atomics). One block over every
// token of a 32768-token micro-batch took 1.1 ms per layer (8.9% of the MoE benchmark's
// step): the sum is a diagnostic and must cost next to nothing.
constexpr int kEntropyBlocks = 128;
constexpr ScratchKind kEntropyPartials{"routing_entropy_sum", kEntropyBlocks * sizeof(double)};

__global__ void add_counts_kernel(const int32_t* __restrict__ counts, int64_t n, int32_t* __restrict__ total) {
  KILN_GRID_STRIDE(i, n) total[i] += counts[i];
}

// Block b, thread i: the tokens b kThreads + i, then a grid's stride on; a token's entropy
// over its experts in fp32 (a diagnostic: seven digits are plenty), the thread's sum in
// double, the block's in its fixed butterfly.
__global__ void __launch_bounds__(kThreads)
    entropy_partials_kernel(const float* __restrict__ probs, int64_t tokens, int64_t e_count, double* __restrict__ partials) {
  double h = 0;
  for (int64_t t = blockIdx.x * int64_t{kThreads} + threadIdx.x; t < tokens; t += int64_t{kEntropyBlocks} * kThreads) {
    const float* p = probs + t * e_count;
    float token_h = 0;
    for (int64_t j = 0; j < e_count; ++j) {
      const float v = p[j];
      if (v > 0) token_h -= v * logf(v);
    }
    h += token_h;
  }
  h = block_reduce<kThreads>(h, SumOp{}, 0.0);
  if (threadIdx.x == 0) partials[blockIdx.x] = h;
}

__global__ void __launch_bounds__(kEntropyBlocks)
    entropy_total_kernel(const double* __restrict__ partials, int64_t tokens, double* __restrict__ sums) {
  const double h = block_reduce<kEntropyBlocks>(partials[threadIdx.x], SumOp{}, 0.0);
  if (threadIdx.x == 0) {
    sums[0] += h;
    sums[1] += static_cast<double>(tokens);
  }
}

__global__ void end_step_kernel(int32_t* __restrict__ counts, double* __restrict__ entropy,
                                int32_t* __restrict__ last_counts, double* __restrict__ last_entropy,
                                int32_t* __restrict__ dead_steps, int64_t e_count) {
  KILN_GRID_STRIDE(e, e_count) {
    const int32_t c = counts[e];
    dead_steps[e] = c == 0 ? dead_steps[e] + 1 : 0;
    last_counts[e] = c;
    counts[e] = 0;
  }
  if (blockIdx.x == 0 && threadIdx.x < 2) {
    last_entropy[threadIdx.x] = entropy[threadIdx.x];
    entropy[threadIdx.x] = 0;
  }
}

__global__ void take_counts_kernel(int32_t* __restrict__ counts, int64_t n, int32_t* __restrict__ last) {
  KILN_GRID_STRIDE(i, n) {
    last[i] = counts[i];
    counts[i] = 0;
  }
}

}  // namespace

void take_counts(const ExecContext& ctx, int32_t* counts, int64_t n, int32_t* last) {
  if (n == 0) return;
  take_counts_kernel<<<blocks_for(n, kThreads), kThreads, 0, stream(ctx)>>>(counts, n, last);
  check_launch("moe_take_counts", "take_counts_kernel");
}

void add_counts(const ExecContext& ctx, const int32_t* counts, int64_t n, int32_t* total) {
  if (n == 0) return;
  add_counts_kernel<<<blocks_for(n, kThreads), kThreads, 0, stream(ctx)>>>(counts, n, total);
  check_launch("moe_accumulate_counts", "add_counts_kernel");
}

void routing_entropy_sum(const ExecContext& ctx, const float* probs, int64_t tokens, int64_t e_count, double* sums) {
  double* const partials = context_scratch_as<double>(ctx, kEntropyPartials);
  entropy_partials_kernel<<<kEntropyBlocks, kThreads, 0, stream(ctx)>>>(probs, tokens, e_count, partials);
  check_launch("routing_entropy_sum", "entropy_partials_kernel");
  entropy_total_kernel<<<1, kEntropyBlocks, 0, stream(ctx)>>>(partials, tokens, sums);
  check_launch("routing_entropy_sum", "entropy_total_kernel");
}

void moe_end_step(const ExecContext& ctx, int32_t* counts, double* entropy, int32_t* last_counts, double* last_entropy, int32_t* dead_steps,
                  int64_t e_count) {
  end_step_kernel<<<blocks_for(e_count, kThreads), kThreads, 0, stream(ctx)>>>(counts, entropy, last_counts,
                                                                            last_entropy, dead_steps, e_count);
  check_launch("moe_end_step", "end_step_kernel");
}

}  // namespace kiln::cuda

// relu's kernels (ReMoE; routing_cuda.h): the gates and routes a warp per token row, the
// backward elementwise, the L1 value over fixed blocks added in a fixed order (the same
// bits every run, no atomics on floats), the coefficient's step on one thread from device
// counts: nothing reads back to the host.
#include "ops/moe/routing_cuda.h"
#include "ops/moe/routing_topk.cuh"

#include "core/context_scratch.h"
#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "ops/grid_stride.cuh"

namespace kiln::cuda {

namespace {

constexpr int kL1Blocks = 128;
constexpr ScratchKind kL1Partials{"relu_l1", kL1Blocks * sizeof(double)};

// Row t: slot e routed where l > 0 (weight l), probs = the gates over their sum (fp64, the
// lane's order then the butterfly).
__global__ void __launch_bounds__(kThreads)
    relu_route_kernel(const float* __restrict__ logits, int64_t tokens, int64_t e_count, float* __restrict__ probs,
                      int32_t* __restrict__ experts, float* __restrict__ weights) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / kWarpSize;
  if (t >= tokens) return;
  const int64_t row = t * e_count;
  double sum = 0;
  for (int64_t j = lane; j < e_count; j += kWarpSize) sum += fmaxf(logits[row + j], 0.0f);
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(kFull, sum, offset);
  for (int64_t j = lane; j < e_count; j += kWarpSize) {
    const float l = logits[row + j];
    const bool on = l > 0.0f;
    experts[row + j] = on ? static_cast<int32_t>(j) : -1;
    weights[row + j] = on ? l : 0.0f;
    probs[row + j] = on ? static_cast<float>(static_cast<double>(l) / sum) : 0.0f;
  }
}

__global__ void relu_backward_kernel(const int32_t* __restrict__ experts, int64_t tokens, int64_t e_count,
                                     const float* __restrict__ dweights, const float* __restrict__ coef,
                                     double grad_scale, const double* __restrict__ device_scale,
                                     float* __restrict__ dlogits) {
  // As the CPU: the L1 step in fp64, one float add; grad_scale times the captured step's
  // loss scale S when device_scale is set.
  if (device_scale) grad_scale *= *device_scale;
  const double l1 = static_cast<double>(coef[0]) * grad_scale / static_cast<double>(tokens);
  KILN_GRID_STRIDE(i, tokens * e_count) {
    dlogits[i] = experts[i] >= 0 ? static_cast<float>(static_cast<double>(dweights[i]) + l1) : 0.0f;
  }
}

// Block b, thread i: the elements b kThreads + i, then a grid's stride on, summed in fp64.
__global__ void __launch_bounds__(kThreads) l1_partials_kernel(const float* __restrict__ logits, int64_t n,
                                                                 double* __restrict__ partials) {
  double s = 0;
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < n; i += int64_t{kL1Blocks} * kThreads)
    s += fmaxf(logits[i], 0.0f);
  s = block_sum<kThreads>(s);
  if (threadIdx.x == 0) partials[blockIdx.x] = s;
}

__global__ void __launch_bounds__(kL1Blocks) l1_total_kernel(const double* __restrict__ partials, int64_t tokens,
                                                           double* __restrict__ sum) {
  const double s = block_sum<kL1Blocks>(partials[threadIdx.x]);
  if (threadIdx.x == 0) *sum += s / static_cast<double>(tokens);
}

__global__ void l1_update_kernel(float* __restrict__ coef, const int32_t* __restrict__ counts, int64_t e_count,
                                 const double* __restrict__ tokens, int64_t top_k, double factor) {
  const double n = *tokens;
  if (n <= 0) return;
  double pairs = 0;  // integers: exact in fp64
  for (int64_t e = 0; e < e_count; ++e) pairs += counts[e];
  const double sparsity = 1.0 - pairs / (n * static_cast<double>(e_count));
  const double target = 1.0 - static_cast<double>(top_k) / static_cast<double>(e_count);
  const double c = static_cast<double>(*coef);
  *coef = static_cast<float>(sparsity < target ? c * factor : c / factor);
}

}  // namespace

void relu_route_forward(const ExecContext& ctx, const float* logits, int64_t tokens, int64_t e_count, float* probs, int32_t* experts,
                        float* weights) {
  if (tokens == 0) return;
  relu_route_kernel<<<row_blocks(tokens), kThreads, 0, stream(ctx)>>>(logits, tokens, e_count, probs, experts, weights);
  check_launch("relu_route", "relu_route_kernel");
}

void relu_route_backward(const ExecContext& ctx, const int32_t* experts, int64_t tokens, int64_t e_count, const float* dweights,
                         const float* coef, double grad_scale, const double* device_scale, float* dlogits) {
  if (tokens == 0) return;
  relu_backward_kernel<<<blocks_for(tokens * e_count, kThreads), kThreads, 0, stream(ctx)>>>(
      experts, tokens, e_count, dweights, coef, grad_scale, device_scale, dlogits);
  check_launch("relu_route_backward", "relu_backward_kernel");
}

void relu_l1_sum(const ExecContext& ctx, const float* logits, int64_t tokens, int64_t e_count, double* sum) {
  if (tokens == 0) return;
  double* const partials = context_scratch_as<double>(ctx, kL1Partials);
  l1_partials_kernel<<<kL1Blocks, kThreads, 0, stream(ctx)>>>(logits, tokens * e_count, partials);
  check_launch("relu_l1", "l1_partials_kernel");
  l1_total_kernel<<<1, kL1Blocks, 0, stream(ctx)>>>(partials, tokens, sum);
  check_launch("relu_l1", "l1_total_kernel");
}

void relu_l1_update(const ExecContext& ctx, float* coef, const int32_t* counts, int64_t e_count, const double* tokens, int64_t top_k,
                    double factor) {
  l1_update_kernel<<<1, 1, 0, stream(ctx)>>>(coef, counts, e_count, tokens, top_k, factor);
  check_launch("relu_l1_update", "l1_update_kernel");
}

}  // namespace kiln::cuda

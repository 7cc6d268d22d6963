// The kernels of the routers that balance by the choice itself (routing_cuda.h): sinkhorn
// and expert_choice. Both start from a softmax per token row (a warp per row, fp32 with
// the CPU's order of operations up to fp32 rounding); every cross-token sum runs in fp64 in
// an order fixed by the shape (a block per expert, its fixed butterfly), so the results are
// the same bits every run, and nothing reads sizes or values back to the host.
#include "ops/moe/routing_cuda.h"
#include "ops/moe/routing_topk.cuh"

#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "ops/grid_stride.cuh"

namespace kiln::cuda {

namespace {

constexpr double kSinkhornEps = 1e-8;  // as the CPU reference (Megatron's)

// probs row t = softmax(logits row t): max and sum in fp32 over the warp, as softmax_topk.
__global__ void __launch_bounds__(kThreads)
    softmax_rows_kernel(const float* __restrict__ logits, int64_t tokens, int64_t e_count, float* __restrict__ probs) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / kWarpSize;
  if (t >= tokens) return;
  const float* l = logits + t * e_count;
  float m = -INFINITY;
  for (int64_t j = lane; j < e_count; j += kWarpSize) m = fmaxf(m, l[j]);
  m = warp_max(m);
  float sum = 0.0f;
  for (int64_t j = lane; j < e_count; j += kWarpSize) sum += expf(l[j] - m);
  sum = warp_sum(sum);
  for (int64_t j = lane; j < e_count; j += kWarpSize) probs[t * e_count + j] = expf(l[j] - m) / sum;
}

void softmax_rows(const ExecContext& ctx, const float* logits, int64_t tokens, int64_t e_count, float* probs, const char* op) {
  softmax_rows_kernel<<<row_blocks(tokens), kThreads, 0, stream(ctx)>>>(logits, tokens, e_count, probs);
  check_launch(op, "softmax_rows_kernel");
}

// ---- sinkhorn ---------------------------------------------------------------------------------

__global__ void fill_kernel(float* __restrict__ v, int64_t n, float value) {
  KILN_GRID_STRIDE(i, n) v[i] = value;
}

// r_t = 1 / (T (sum_e c_e p_te + eps)): a warp per row, each lane's sum in order, then the
// butterfly (fp64).
__global__ void __launch_bounds__(kThreads)
    row_scale_kernel(const float* __restrict__ probs, const float* __restrict__ col_scale, int64_t tokens,
                     int64_t e_count, float* __restrict__ row_scale) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / kWarpSize;
  if (t >= tokens) return;
  double s = 0;
  for (int64_t j = lane; j < e_count; j += kWarpSize)
    s += static_cast<double>(col_scale[j]) * static_cast<double>(probs[t * e_count + j]);
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) s += __shfl_xor_sync(kFull, s, offset);
  if (lane == 0) row_scale[t] = static_cast<float>(1.0 / (static_cast<double>(tokens) * (s + kSinkhornEps)));
}

// Block e: c_e = 1 / (E (sum_t r_t p_te + eps)), the block's fixed order (fp64).
__global__ void __launch_bounds__(kThreads)
    col_scale_kernel(const float* __restrict__ probs, const float* __restrict__ row_scale, int64_t tokens,
                     int64_t e_count, float* __restrict__ col_scale) {
  const int64_t e = blockIdx.x;
  double s = 0;
  for (int64_t t = threadIdx.x; t < tokens; t += kThreads)
    s += static_cast<double>(row_scale[t]) * static_cast<double>(probs[t * e_count + e]);
  s = block_sum<kThreads>(s);
  if (threadIdx.x == 0) col_scale[e] = static_cast<float>(1.0 / (static_cast<double>(e_count) * (s + kSinkhornEps)));
}

// The k largest c_e p_te of row t (keys), weighted by p (scores).
template <int kPer>
__global__ void __launch_bounds__(kThreads)
    scaled_topk_kernel(const float* __restrict__ probs, const float* __restrict__ col_scale, int64_t tokens,
                       int64_t e_count, int64_t k, bool normalize, int32_t* __restrict__ experts,
                       float* __restrict__ weights) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / kWarpSize;
  if (t >= tokens) return;
  const uint32_t valid = valid_slots<kPer>(lane, e_count);
  float key[kPer], p[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int64_t j = lane + kWarpSize * i;
    const bool v = valid >> i & 1u;
    p[i] = v ? probs[t * e_count + j] : 0.0f;
    key[i] = v ? col_scale[j] * p[i] : -INFINITY;
  }
  int my_id[kPer];
  float my_p[kPer];
  const float chosen = choose_top_k(key, p, valid, k, lane, my_id, my_p);
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int64_t r = lane + kWarpSize * i;
    if (r >= k) continue;
    experts[t * k + r] = my_id[i];
    weights[t * k + r] = normalize ? my_p[i] / chosen : my_p[i];
  }
}

// ---- expert_choice ----------------------------------------------------------------------------

constexpr int kChoiceThreads = 256;

// Tokens of column e whose probability's bits are >= `bits` (non-negative floats order as
// their bit patterns), summed over the block.
__device__ int64_t count_at_least(const float* __restrict__ probs, int64_t tokens, int64_t e_count, int64_t e,
                                  uint32_t bits, bool strictly) {
  double n = 0;  // integer counts: exact in fp64 in any order
  for (int64_t t = threadIdx.x; t < tokens; t += kChoiceThreads) {
    const uint32_t b = __float_as_uint(probs[t * e_count + e]);
    n += strictly ? (b > bits) : (b >= bits);
  }
  return static_cast<int64_t>(block_sum<kChoiceThreads>(n));
}

// Block e: the capacity-th largest probability of column e found bit by bit from the top
// (the largest pattern u with capacity tokens at or above it), then every token above it
// and, of those equal to it, the lowest tokens until capacity: a ballot scan in token order.
__global__ void __launch_bounds__(kChoiceThreads)
    expert_choice_kernel(const float* __restrict__ probs, int64_t tokens, int64_t e_count, int64_t capacity,
                         int32_t* __restrict__ experts, float* __restrict__ weights) {
  __shared__ int32_t warp_ties[kChoiceThreads / kWarpSize];
  const int64_t e = blockIdx.x;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  uint32_t threshold = 0;
  if (capacity > 0) {
    for (int b = 31; b >= 0; --b) {
      const uint32_t candidate = threshold | (1u << b);
      if (count_at_least(probs, tokens, e_count, e, candidate, false) >= capacity) threshold = candidate;
    }
  }
  const int64_t above = capacity > 0 ? count_at_least(probs, tokens, e_count, e, threshold, true) : 0;
  int64_t ties_left = capacity - above, ties_before = 0;
  for (int64_t base = 0; base < tokens; base += kChoiceThreads) {
    const int64_t t = base + threadIdx.x;
    const float p = t < tokens ? probs[t * e_count + e] : 0.0f;
    const uint32_t b = __float_as_uint(p);
    const bool tie = t < tokens && capacity > 0 && b == threshold;
    const unsigned ballot = __ballot_sync(kFull, tie);
    if (lane == 0) warp_ties[warp] = __popc(ballot);
    __syncthreads();
    int64_t rank = ties_before + __popc(ballot & ((1u << lane) - 1u));
    for (int w = 0; w < warp; ++w) rank += warp_ties[w];
    int64_t block_ties = 0;
    for (int w = 0; w < kChoiceThreads / kWarpSize; ++w) block_ties += warp_ties[w];
    __syncthreads();
    ties_before += block_ties;
    if (t >= tokens) continue;
    const bool taken = capacity > 0 && (b > threshold || (tie && rank < ties_left));
    experts[t * e_count + e] = taken ? static_cast<int32_t>(e) : -1;
    weights[t * e_count + e] = taken ? p : 0.0f;
  }
}

}  // namespace

void sinkhorn_topk_forward(const ExecContext& ctx, const float* logits, int64_t tokens, int64_t e_count, int64_t k, int64_t iterations,
                           bool normalize, float* probs, float* row_scale, float* col_scale, int32_t* experts,
                           float* weights) {
  constexpr const char* kOp = "sinkhorn_topk";
  if (tokens == 0) return;
  softmax_rows(ctx, logits, tokens, e_count, probs, kOp);
  fill_kernel<<<blocks_for(e_count, kThreads), kThreads, 0, stream(ctx)>>>(col_scale, e_count, 1.0f);
  check_launch(kOp, "fill_kernel");
  for (int64_t it = 0; it < iterations; ++it) {
    row_scale_kernel<<<row_blocks(tokens), kThreads, 0, stream(ctx)>>>(probs, col_scale, tokens, e_count, row_scale);
    check_launch(kOp, "row_scale_kernel");
    col_scale_kernel<<<static_cast<unsigned>(e_count), kThreads, 0, stream(ctx)>>>(probs, row_scale, tokens, e_count,
                                                                                col_scale);
    check_launch(kOp, "col_scale_kernel");
  }
  by_width(e_count, [&]<int kPer>() {
    scaled_topk_kernel<kPer><<<row_blocks(tokens), kThreads, 0, stream(ctx)>>>(probs, col_scale, tokens, e_count, k,
                                                                            normalize, experts, weights);
    check_launch(kOp, "scaled_topk_kernel");
  });
}

void expert_choice_forward(const ExecContext& ctx, const float* logits, int64_t tokens, int64_t e_count, int64_t capacity, float* probs,
                           int32_t* experts, float* weights) {
  constexpr const char* kOp = "expert_choice";
  if (tokens == 0) return;
  softmax_rows(ctx, logits, tokens, e_count, probs, kOp);
  expert_choice_kernel<<<static_cast<unsigned>(e_count), kChoiceThreads, 0, stream(ctx)>>>(probs, tokens, e_count,
                                                                                        capacity, experts, weights);
  check_launch(kOp, "expert_choice_kernel");
}

}  // namespace kiln::cuda

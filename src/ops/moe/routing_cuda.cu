// The routers' kernels (declared in routing_cuda.h). A warp per token row, eight rows per
// 256-thread block. The routers keep a row's E values in registers, kPer = E / 32 rounded
// up to a power of two per lane (expert j at lane j % 32, slot j / 32), and choose the top
// k in k rounds of a warp argmax (the larger key, equal keys the lower id), so every lane
// knows each round's winner. Softmax, sigmoid and their backwards compute in fp32; the
// z-loss's logsumexp and both losses' sums in fp64, as the CPU reference does.
//
// Loss values: per-block partial sums in a fixed order into the context's device scratch
// (core/context_scratch.h), then one warp adds the partials in order and adds the total to
// the caller's double. Each stream has its own scratch and runs its calls one after another,
// so two calls never share it at once.
#include "ops/moe/routing_cuda.h"
#include "ops/moe/routing_topk.cuh"

#include "core/context_scratch.h"
#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "core/error.h"
#include "ops/block_reduce.cuh"
#include "ops/grid_stride.cuh"

#include <algorithm>
#include <climits>

namespace kiln::cuda {

namespace {

// ---- softmax_topk ---------------------------------------------------------------------------

template <int kPer>
__global__ void __launch_bounds__(kThreads)
    softmax_topk_kernel(const float* __restrict__ logits, int64_t tokens, int64_t e_count, int64_t k, bool normalize,
                        float* __restrict__ probs, int32_t* __restrict__ experts, float* __restrict__ weights) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / kWarpSize;
  if (t >= tokens) return;  // whole warps leave together
  const float* l = logits + t * e_count;
  const uint32_t valid = valid_slots<kPer>(lane, e_count);
  float p[kPer];
  float m = -INFINITY;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    p[i] = (valid >> i & 1u) ? l[lane + kWarpSize * i] : -INFINITY;
    m = fmaxf(m, p[i]);
  }
  m = warp_max(m);
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    p[i] = (valid >> i & 1u) ? expf(p[i] - m) : 0.0f;
    sum += p[i];
  }
  sum = warp_sum(sum);
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    p[i] /= sum;
    if (valid >> i & 1u) probs[t * e_count + lane + kWarpSize * i] = p[i];
  }
  // Chosen on the stored probabilities, as the CPU reference.
  int my_id[kPer];
  float my_p[kPer];
  const float chosen = choose_top_k(p, p, valid, k, lane, my_id, my_p);
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int64_t r = lane + kWarpSize * i;
    if (r >= k) continue;
    experts[t * k + r] = my_id[i];
    weights[t * k + r] = normalize ? my_p[i] / chosen : my_p[i];
  }
}

// dp = dprobs + the weights' part (w_r = p_r / S when normalized: dp_i += (dw_i - sum_r
// dw_r w_r) / S); dlogits = p (dp - sum p dp).
template <int kPer>
__global__ void __launch_bounds__(kThreads)
    softmax_topk_backward_kernel(const float* __restrict__ probs, const int32_t* __restrict__ experts,
                                 const float* __restrict__ weights, int64_t tokens, int64_t e_count, int64_t k,
                                 bool normalize, const float* __restrict__ dweights, const float* __restrict__ dprobs,
                                 float* __restrict__ dlogits) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / kWarpSize;
  if (t >= tokens) return;
  const int64_t row = t * e_count;
  const uint32_t valid = valid_slots<kPer>(lane, e_count);
  float p[kPer], dp[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const bool v = valid >> i & 1u;
    p[i] = v ? probs[row + lane + kWarpSize * i] : 0.0f;
    dp[i] = v && dprobs ? dprobs[row + lane + kWarpSize * i] : 0.0f;
  }
  const int32_t* ids = experts + t * k;
  const float* dw = dweights + t * k;
  float chosen = 0.0f, dot = 0.0f;
  if (normalize)
    for (int64_t r = 0; r < k; ++r)
      if (ids[r] >= 0) chosen += probs[row + ids[r]], dot += dw[r] * weights[t * k + r];
  for (int64_t r = 0; r < k; ++r) {
    const int e = ids[r];  // -1: an empty slot (expert_choice's), matching no lane
    const float add = normalize ? (dw[r] - dot) / chosen : dw[r];
#pragma unroll
    for (int i = 0; i < kPer; ++i)
      if (e == lane + kWarpSize * i) dp[i] += add;
  }
  float pdp = 0.0f;
#pragma unroll
  for (int i = 0; i < kPer; ++i) pdp += p[i] * dp[i];
  pdp = warp_sum(pdp);
#pragma unroll
  for (int i = 0; i < kPer; ++i)
    if (valid >> i & 1u) dlogits[row + lane + kWarpSize * i] = p[i] * (dp[i] - pdp);
}

// ---- sigmoid_bias ----------------------------------------------------------------------------

// keys: kWarps x E floats of shared memory (the group scores read other lanes' keys).
template <int kPer>
__global__ void __launch_bounds__(kThreads)
    sigmoid_bias_kernel(const float* __restrict__ logits, const float* __restrict__ bias, int64_t tokens,
                        int64_t e_count, int64_t k, int64_t groups, int64_t top_groups, bool normalize, float scaling,
                        float* __restrict__ scores, int32_t* __restrict__ experts, float* __restrict__ weights) {
  extern __shared__ float staged_keys[];
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  if (t >= tokens) return;
  const float* l = logits + t * e_count;
  const uint32_t valid = valid_slots<kPer>(lane, e_count);
  float s[kPer], key[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int64_t j = lane + kWarpSize * i;
    if (!(valid >> i & 1u)) {
      s[i] = 0.0f, key[i] = -INFINITY;
      continue;
    }
    s[i] = 1.0f / (1.0f + expf(-l[j]));
    scores[t * e_count + j] = s[i];
    key[i] = s[i] + bias[j];
  }
  uint32_t allowed = valid;
  if (groups > 1) {
    // A group's key: the sum of its two best keys (its one key if it has one).
    float* keys = staged_keys + warp * e_count;
#pragma unroll
    for (int i = 0; i < kPer; ++i)
      if (valid >> i & 1u) keys[lane + kWarpSize * i] = key[i];
    __syncwarp();
    const int64_t size = e_count / groups;
    float group_key[kPer], no_scores[kPer];
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int64_t g = lane + kWarpSize * i;
      group_key[i] = -INFINITY, no_scores[i] = 0.0f;
      if (g >= groups) continue;
      float first = -INFINITY, second = -INFINITY;
      for (int64_t j = g * size; j < (g + 1) * size; ++j) {
        const float v = keys[j];
        if (v > first) second = first, first = v;
        else if (v > second) second = v;
      }
      group_key[i] = first + (size > 1 ? second : 0.0f);
    }
    int group_id[kPer];
    float group_unused[kPer];
    choose_top_k(group_key, no_scores, valid_slots<kPer>(lane, groups), top_groups, lane, group_id, group_unused);
    // Every lane needs every chosen group: they sit on lanes r % 32 at slot r / 32.
    allowed = 0;
    for (int64_t r = 0; r < top_groups; ++r) {
      int g = 0;
#pragma unroll
      for (int i = 0; i < kPer; ++i)
        if (r / kWarpSize == i) g = __shfl_sync(kFull, group_id[i], static_cast<int>(r % kWarpSize));
#pragma unroll
      for (int i = 0; i < kPer; ++i)
        if ((valid >> i & 1u) && (lane + kWarpSize * i) / size == g) allowed |= 1u << i;
    }
  }
  int my_id[kPer];
  float my_s[kPer];
  const float chosen = choose_top_k(key, s, allowed, k, lane, my_id, my_s);
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int64_t r = lane + kWarpSize * i;
    if (r >= k) continue;
    experts[t * k + r] = my_id[i];
    weights[t * k + r] = (normalize ? my_s[i] / (chosen + 1e-20f) : my_s[i]) * scaling;
  }
}

// ds = dscores + the weights' part (w_r = c s_r / (S + eps) when normalized); dlogits =
// ds s (1 - s).
template <int kPer>
__global__ void __launch_bounds__(kThreads)
    sigmoid_bias_backward_kernel(const float* __restrict__ scores, const int32_t* __restrict__ experts, int64_t tokens,
                                 int64_t e_count, int64_t k, bool normalize, float scaling,
                                 const float* __restrict__ dweights, const float* __restrict__ dscores,
                                 float* __restrict__ dlogits) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / kWarpSize;
  if (t >= tokens) return;
  const int64_t row = t * e_count;
  const uint32_t valid = valid_slots<kPer>(lane, e_count);
  float s[kPer], ds[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const bool v = valid >> i & 1u;
    s[i] = v ? scores[row + lane + kWarpSize * i] : 0.0f;
    ds[i] = v && dscores ? dscores[row + lane + kWarpSize * i] : 0.0f;
  }
  const int32_t* ids = experts + t * k;
  const float* dw = dweights + t * k;
  float denom = 0.0f, dot = 0.0f;
  if (normalize) {
    for (int64_t r = 0; r < k; ++r) denom += scores[row + ids[r]];
    denom += 1e-20f;
    for (int64_t r = 0; r < k; ++r) dot += dw[r] * scores[row + ids[r]] / denom;
  }
  for (int64_t r = 0; r < k; ++r) {
    const int e = ids[r];
    const float add = normalize ? scaling * (dw[r] - dot) / denom : scaling * dw[r];
#pragma unroll
    for (int i = 0; i < kPer; ++i)
      if (e == lane + kWarpSize * i) ds[i] += add;
  }
#pragma unroll
  for (int i = 0; i < kPer; ++i)
    if (valid >> i & 1u) dlogits[row + lane + kWarpSize * i] = ds[i] * s[i] * (1.0f - s[i]);
}

// ---- row normalization (sigmoid_bias's distribution for the balance loss) -----------------

__global__ void __launch_bounds__(kThreads)
    row_normalize_kernel(const float* __restrict__ scores, int64_t tokens, int64_t e_count, float* __restrict__ probs) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / kWarpSize;
  if (t >= tokens) return;
  const float* s = scores + t * e_count;
  float sum = 0.0f;
  for (int64_t j = lane; j < e_count; j += kWarpSize) sum += s[j];
  sum = warp_sum(sum);
  for (int64_t j = lane; j < e_count; j += kWarpSize) probs[t * e_count + j] = s[j] / sum;
}

// ds_m = (dp_m - sum_j dp_j p_j) / sum(s).
__global__ void __launch_bounds__(kThreads)
    row_normalize_backward_kernel(const float* __restrict__ scores, const float* __restrict__ probs,
                                  const float* __restrict__ dprobs, int64_t tokens, int64_t e_count,
                                  float* __restrict__ dscores) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / kWarpSize;
  if (t >= tokens) return;
  const int64_t row = t * e_count;
  float sum = 0.0f, dot = 0.0f;
  for (int64_t j = lane; j < e_count; j += kWarpSize) sum += scores[row + j], dot += dprobs[row + j] * probs[row + j];
  sum = warp_sum(sum);
  dot = warp_sum(dot);
  for (int64_t j = lane; j < e_count; j += kWarpSize) dscores[row + j] = (dprobs[row + j] - dot) / sum;
}

// ---- losses -----------------------------------------------------------------------------------

constexpr int kMaxPartials = 1024;
// The losses' per-block partials, and the loss value the front ends read back, in the
// context's device scratch (core/context_scratch.h).
constexpr ScratchKind kLossPartials{"moe losses", kMaxPartials * sizeof(double)};
constexpr ScratchKind kLossValue{"moe loss value", sizeof(double)};

double* partials(const ExecContext& ctx) { return context_scratch_as<double>(ctx, kLossPartials); }

// *sum += scale x the sum of partials [0, n) (in lane order, then the butterfly); with
// step_tokens (the step scope's, once counted) / *step_tokens in place of scale.
__global__ void add_partials(const double* __restrict__ partial, int n, double scale, const double* __restrict__ step_tokens,
                             double* __restrict__ sum) {
  double total = 0;
  for (int i = threadIdx.x; i < n; i += kWarpSize) total += partial[i];
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) total += __shfl_xor_sync(kFull, total, offset);
  if (threadIdx.x != 0) return;
  *sum += step_tokens != nullptr && *step_tokens > 0 ? total / *step_tokens : total * scale;
}

// Block e: expert e's term E f_e P_e, with P_e's column sum in fp64 (the block's fixed order).
__global__ void __launch_bounds__(kThreads)
    balance_terms(const float* __restrict__ probs, balance_scope::Counts counts, double* __restrict__ terms) {
  const int64_t e = blockIdx.x, tokens = counts.tokens, e_count = counts.e_count;
  double p = 0;
  for (int64_t t = threadIdx.x; t < tokens; t += kThreads) p += probs[t * e_count + e];
  p = block_sum<kThreads>(p);
  if (threadIdx.x == 0) terms[e] = counts.term(e, p);
}

// dprobs[t, e] (+)= grad_scale E f_e / T (as the CPU: the step in fp64, one float add);
// grad_scale times *device_scale (the loss scale S of a captured step) when it is set.
__global__ void balance_gradient(balance_scope::Counts counts, double grad_scale, const double* __restrict__ device_scale,
                                 float* __restrict__ dprobs, bool accumulate) {
  if (device_scale) grad_scale *= *device_scale;
  KILN_GRID_STRIDE(i, counts.tokens * counts.e_count) {
    const float g = static_cast<float>(counts.gradient(i % counts.e_count, grad_scale));
    dprobs[i] = accumulate ? dprobs[i] + g : g;
  }
}

// step[e] += counts[e], step[E] += tokens: one thread per element, integers in fp64 (exact).
__global__ void step_routes_add_kernel(const int32_t* __restrict__ counts, int64_t e_count, int64_t tokens,
                                       double* __restrict__ step) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e < e_count) step[e] += static_cast<double>(counts[e]);
  else if (e == e_count) step[e] += static_cast<double>(tokens);
}

// Warp w of the grid takes rows w, w + warps, ...: each row's logsumexp in fp64 (its max in
// fp32), lse^2 summed per warp in row order, the block's warps in order into partial[block];
// with dlogits, += grad_scale 2 lse / T softmax(row) (grad_scale times *device_scale when set).
__global__ void __launch_bounds__(kThreads)
    z_loss_rows(const float* __restrict__ logits, int64_t tokens, int64_t e_count, const double* __restrict__ step_tokens,
                double grad_scale, const double* __restrict__ device_scale, double* __restrict__ partial,
                float* __restrict__ dlogits) {
  __shared__ double warp_values[kWarps];
  if (dlogits && device_scale) grad_scale *= *device_scale;
  const double mean_over = balance_scope::routed_tokens(step_tokens, tokens);
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  double value = 0;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + warp; t < tokens; t += warps) {
    const float* l = logits + t * e_count;
    float m = -INFINITY;
    for (int64_t j = lane; j < e_count; j += kWarpSize) m = fmaxf(m, l[j]);
    m = warp_max(m);
    double sum = 0;
    for (int64_t j = lane; j < e_count; j += kWarpSize) sum += exp(static_cast<double>(l[j]) - m);
#pragma unroll
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(kFull, sum, offset);
    const double lse = m + log(sum);
    value += lse * lse;
    if (!dlogits) continue;
    const double g = grad_scale * 2.0 * lse / mean_over;
    for (int64_t j = lane; j < e_count; j += kWarpSize)
      dlogits[t * e_count + j] += static_cast<float>(g * exp(static_cast<double>(l[j]) - lse));
  }
  if (lane == 0) warp_values[warp] = value;
  __syncthreads();
  if (threadIdx.x == 0 && partial) {
    double total = 0;
    for (int w = 0; w < kWarps; ++w) total += warp_values[w];
    partial[blockIdx.x] = total;
  }
}

__global__ void bias_update_kernel(float* __restrict__ bias, const int32_t* __restrict__ counts, int64_t e_count,
                                   bool sign_rule, double rate) {
  // Integer counts sum exactly in fp64 in any order: the CPU's mean to the bit.
  double total = 0;
  for (int64_t j = threadIdx.x; j < e_count; j += blockDim.x) total += counts[j];
  total = block_sum<kRoutingMaxExperts>(total);
  const double mean = total / static_cast<double>(e_count);
  if (mean <= 0) return;
  for (int64_t j = threadIdx.x; j < e_count; j += blockDim.x) {
    const double error = mean - counts[j];  // > 0: the expert is under-loaded
    const double step = sign_rule ? rate * ((error > 0) - (error < 0)) : rate * error / mean;
    bias[j] += static_cast<float>(step);
  }
}

__global__ void reset_kernel(double* sum) { *sum = 0; }

}  // namespace

void softmax_topk_forward(const ExecContext& ctx, const float* logits, int64_t tokens, int64_t e_count, int64_t k, bool normalize,
                          float* probs, int32_t* experts, float* weights) {
  if (tokens == 0) return;
  by_width(e_count, [&]<int kPer>() {
    softmax_topk_kernel<kPer><<<row_blocks(tokens), kThreads, 0, stream(ctx)>>>(logits, tokens, e_count, k, normalize,
                                                                             probs, experts, weights);
    check_launch("softmax_topk", "softmax_topk_kernel");
  });
}

void softmax_topk_backward(const ExecContext& ctx, const float* probs, const int32_t* experts, const float* weights, int64_t tokens,
                           int64_t e_count, int64_t k, bool normalize, const float* dweights, const float* dprobs,
                           float* dlogits) {
  if (tokens == 0) return;
  by_width(e_count, [&]<int kPer>() {
    softmax_topk_backward_kernel<kPer><<<row_blocks(tokens), kThreads, 0, stream(ctx)>>>(
        probs, experts, weights, tokens, e_count, k, normalize, dweights, dprobs, dlogits);
    check_launch("softmax_topk_backward", "softmax_topk_backward_kernel");
  });
}

void sigmoid_bias_forward(const ExecContext& ctx, const float* logits, const float* bias, int64_t tokens, int64_t e_count, int64_t k,
                          int64_t groups, int64_t top_groups, bool normalize, float scaling, float* scores,
                          int32_t* experts, float* weights) {
  if (tokens == 0) return;
  const size_t shared = groups > 1 ? static_cast<size_t>(kWarps * e_count) * sizeof(float) : 0;
  by_width(e_count, [&]<int kPer>() {
    sigmoid_bias_kernel<kPer><<<row_blocks(tokens), kThreads, shared, stream(ctx)>>>(
        logits, bias, tokens, e_count, k, groups, top_groups, normalize, scaling, scores, experts, weights);
    check_launch("sigmoid_bias", "sigmoid_bias_kernel");
  });
}

void sigmoid_bias_backward(const ExecContext& ctx, const float* scores, const int32_t* experts, int64_t tokens, int64_t e_count, int64_t k,
                           bool normalize, float scaling, const float* dweights, const float* dscores, float* dlogits) {
  if (tokens == 0) return;
  by_width(e_count, [&]<int kPer>() {
    sigmoid_bias_backward_kernel<kPer><<<row_blocks(tokens), kThreads, 0, stream(ctx)>>>(
        scores, experts, tokens, e_count, k, normalize, scaling, dweights, dscores, dlogits);
    check_launch("sigmoid_bias_backward", "sigmoid_bias_backward_kernel");
  });
}

void row_normalize_forward(const ExecContext& ctx, const float* scores, int64_t tokens, int64_t e_count, float* probs) {
  if (tokens == 0) return;
  row_normalize_kernel<<<row_blocks(tokens), kThreads, 0, stream(ctx)>>>(scores, tokens, e_count, probs);
  check_launch("row_normalize", "row_normalize_kernel");
}

void row_normalize_backward(const ExecContext& ctx, const float* scores, const float* probs, const float* dprobs, int64_t tokens,
                            int64_t e_count, float* dscores) {
  if (tokens == 0) return;
  row_normalize_backward_kernel<<<row_blocks(tokens), kThreads, 0, stream(ctx)>>>(scores, probs, dprobs, tokens, e_count,
                                                                               dscores);
  check_launch("row_normalize_backward", "row_normalize_backward_kernel");
}

void balance_loss(const ExecContext& ctx, const float* probs, const balance_scope::Counts& counts, double grad_scale,
                  const double* device_scale, double* sum, float* dprobs, bool accumulate) {
  constexpr const char* kOp = "balance_loss";
  const int64_t tokens = counts.tokens, e_count = counts.e_count;
  KILN_CHECK(e_count <= kMaxPartials, kOp, "{} experts", e_count);
  if (tokens == 0) return;
  if (sum) {
    balance_terms<<<static_cast<unsigned>(e_count), kThreads, 0, stream(ctx)>>>(probs, counts, partials(ctx));
    check_launch(kOp, "balance_terms");
    add_partials<<<1, kWarpSize, 0, stream(ctx)>>>(partials(ctx), static_cast<int>(e_count), 1.0, nullptr, sum);
    check_launch(kOp, "add_partials");
  }
  if (dprobs) {
    balance_gradient<<<blocks_for(tokens * e_count, kThreads), kThreads, 0, stream(ctx)>>>(counts, grad_scale, device_scale,
                                                                                        dprobs, accumulate);
    check_launch(kOp, "balance_gradient");
  }
}

void balance_step_routes_add(const ExecContext& ctx, const int32_t* counts, int64_t e_count, int64_t tokens, double* step) {
  step_routes_add_kernel<<<blocks_for(e_count + 1, kThreads), kThreads, 0, stream(ctx)>>>(counts, e_count, tokens, step);
  check_launch("balance_step_routes_add", "step_routes_add_kernel");
}

void router_z_loss(const ExecContext& ctx, const float* logits, int64_t tokens, int64_t e_count, const double* step_tokens,
                   double grad_scale, const double* device_scale, double* sum, float* dlogits) {
  constexpr const char* kOp = "router_z_loss";
  if (tokens == 0 || (!sum && !dlogits)) return;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(row_blocks(tokens), kMaxPartials));
  z_loss_rows<<<blocks, kThreads, 0, stream(ctx)>>>(logits, tokens, e_count, step_tokens, grad_scale, device_scale,
                                                 sum ? partials(ctx) : nullptr, dlogits);
  check_launch(kOp, "z_loss_rows");
  if (!sum) return;
  add_partials<<<1, kWarpSize, 0, stream(ctx)>>>(partials(ctx), static_cast<int>(blocks), 1.0 / static_cast<double>(tokens),
                                              step_tokens, sum);
  check_launch(kOp, "add_partials");
}

void sigmoid_bias_update(const ExecContext& ctx, float* bias, const int32_t* counts, int64_t e_count, bool sign_rule, double rate) {
  KILN_CHECK(e_count <= kRoutingMaxExperts, "sigmoid_bias", "{} experts", e_count);
  bias_update_kernel<<<1, kRoutingMaxExperts, 0, stream(ctx)>>>(bias, counts, e_count, sign_rule, rate);
  check_launch("sigmoid_bias", "bias_update_kernel");
}

double* own_loss_sum(const ExecContext& ctx) { return context_scratch_as<double>(ctx, kLossValue); }

void reset_loss_sum(const ExecContext& ctx, double* sum) {
  reset_kernel<<<1, 1, 0, stream(ctx)>>>(sum);
  check_launch("moe losses", "reset_kernel");
}

double read_loss_sum(const ExecContext& ctx, const double* sum) {
  double host = 0;
  check(cudaMemcpyAsync(&host, sum, sizeof(host), cudaMemcpyDeviceToHost, stream(ctx)), "moe losses", "copy the sum");
  check(cudaStreamSynchronize(stream(ctx)), "moe losses", "synchronize");
  return host;
}

}  // namespace kiln::cuda

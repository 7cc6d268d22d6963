// fp32 causal GQA attention over packed sequences on the GPU: a direct, exact kernel
// set (one warp per query row or key row) that is the correctness baseline for the
// fused paths that replace it (cuDNN SDPA / flash kernels). Deterministic: each output
// element is written by exactly one warp, with sums in a fixed order.
#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "ops/attention/attention_cuda.h"
#include "ops/block_reduce.cuh"
#include "ops/dropout/dropout_mask.h"

namespace kiln::cuda {

namespace {

constexpr int kWarp = 32;
constexpr int kWarpsPerBlock = 8;
constexpr int kMaxPerLane = 8;  // head_dim <= 256


// The sequence holding token i: largest s with cu[s] <= i (skips empty sequences).
__device__ __forceinline__ int64_t find_seq(const int32_t* cu, int64_t num_seqs, int64_t i) {
  int64_t lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (cu[mid] <= i) lo = mid; else hi = mid - 1;
  }
  return lo;
}

struct Row {  // a head_dim vector spread over a warp: element lane + 32 r in slot r
  float v[kMaxPerLane];
  __device__ void zero() {
#pragma unroll
    for (int r = 0; r < kMaxPerLane; ++r) v[r] = 0.0f;
  }
  __device__ void load(const float* p, int64_t d, int lane) {
#pragma unroll
    for (int r = 0; r < kMaxPerLane; ++r) v[r] = lane + kWarp * r < d ? p[lane + kWarp * r] : 0.0f;
  }
  __device__ float dot(const float* p, int64_t d, int lane) const {
    float s = 0;
#pragma unroll
    for (int r = 0; r < kMaxPerLane; ++r)
      if (lane + kWarp * r < d) s += v[r] * p[lane + kWarp * r];
    return warp_sum(s);
  }
  __device__ void axpy(float a, const float* p, int64_t d, int lane) {
#pragma unroll
    for (int r = 0; r < kMaxPerLane; ++r)
      if (lane + kWarp * r < d) v[r] += a * p[lane + kWarp * r];
  }
  __device__ void store(float* p, int64_t d, int lane, float scale) const {
#pragma unroll
    for (int r = 0; r < kMaxPerLane; ++r)
      if (lane + kWarp * r < d) p[lane + kWarp * r] = v[r] * scale;
  }
};

// Scaled (and soft-capped) score; t gets tanh(raw / cap) for the backward.
__device__ __forceinline__ float capped(float raw, float cap, float* t) {
  if (cap > 0) {
    *t = tanhf(raw / cap);
    return *t * cap;
  }
  return raw;
}

// Dropout of the probabilities: a row's hash (the same for every lane), then each key's
// weight, 0 or 1 / (1 - p) (dropout::attention_keeps, the CPU's mask); 1 without dropout.
struct DropoutRow {
  uint64_t row_key = 0;
  bool on = false;
  __device__ DropoutRow(const AttentionArgs& a, int64_t row) : on(a.dropout_key != nullptr) {
    if (on) row_key = dropout::attention_row_key(dropout::key_of_words(a.dropout_key), a.dropout_site, row);
  }
  __device__ float weight(const AttentionArgs& a, int64_t j) const {
    if (!on) return 1.0f;
    return dropout::attention_keeps(row_key, static_cast<uint64_t>(j), a.dropout_threshold) ? a.dropout_scale : 0.0f;
  }
};

__global__ void forward_kernel(AttentionArgs a, const float* __restrict__ q, const float* __restrict__ k,
                               const float* __restrict__ v, float* __restrict__ out, float* __restrict__ lse) {
  const int64_t warp = blockIdx.x * static_cast<int64_t>(kWarpsPerBlock) + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (warp >= a.tokens * a.q_heads) return;
  const int64_t i = warp / a.q_heads, h = warp % a.q_heads, g = h / (a.q_heads / a.kv_heads), d = a.head_dim;
  const int64_t begin = a.cu_seqlens[find_seq(a.cu_seqlens, a.num_seqs, i)];
  const int64_t first = a.window > 0 ? max(begin, i - a.window + 1) : begin;
  Row qi, acc;
  qi.load(q + (i * a.q_heads + h) * d, d, lane);
  acc.zero();
  float m = -INFINITY, l = 0, t = 0;
  const DropoutRow drop(a, i * a.q_heads + h);
  for (int64_t j = first; j <= i; ++j) {
    const float s = capped(qi.dot(k + (j * a.kv_heads + g) * d, d, lane) * a.scale, a.softcap, &t);
    if (s > m) {
      const float correction = __expf(m - s);
      l *= correction;
#pragma unroll
      for (int r = 0; r < kMaxPerLane; ++r) acc.v[r] *= correction;
      m = s;
    }
    const float p = __expf(s - m);
    l += p;
    acc.axpy(p * drop.weight(a, j), v + (j * a.kv_heads + g) * d, d, lane);  // the sum l stays undropped
  }
  acc.store(out + (i * a.q_heads + h) * d, d, lane, 1.0f / l);
  if (lane == 0) lse[i * a.q_heads + h] = m + logf(l);
}

// dq for one (query row, head): dS_ij = P_ij (dO_i . v_j - dO_i . O_i), dq_i = scale sum_j dS_ij k_j.
// With dropout, dS_ij = P_ij (Z_ij dO_i . v_j - dO_i . O_i), O the dropped output.
__global__ void dq_kernel(AttentionArgs a, const float* __restrict__ q, const float* __restrict__ k,
                          const float* __restrict__ v, const float* __restrict__ out, const float* __restrict__ lse,
                          const float* __restrict__ dout, float* __restrict__ dq) {
  const int64_t warp = blockIdx.x * static_cast<int64_t>(kWarpsPerBlock) + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (warp >= a.tokens * a.q_heads) return;
  const int64_t i = warp / a.q_heads, h = warp % a.q_heads, g = h / (a.q_heads / a.kv_heads), d = a.head_dim;
  const int64_t begin = a.cu_seqlens[find_seq(a.cu_seqlens, a.num_seqs, i)];
  const int64_t first = a.window > 0 ? max(begin, i - a.window + 1) : begin;
  const int64_t row = (i * a.q_heads + h) * d;
  Row qi, doi, dqi;
  qi.load(q + row, d, lane);
  doi.load(dout + row, d, lane);
  dqi.zero();
  const float delta = doi.dot(out + row, d, lane), lse_i = lse[i * a.q_heads + h];
  float t = 0;
  const DropoutRow drop(a, i * a.q_heads + h);
  for (int64_t j = first; j <= i; ++j) {
    const float* kj = k + (j * a.kv_heads + g) * d;
    const float p = __expf(capped(qi.dot(kj, d, lane) * a.scale, a.softcap, &t) - lse_i);
    float ds = p * (drop.weight(a, j) * doi.dot(v + (j * a.kv_heads + g) * d, d, lane) - delta);
    if (a.softcap > 0) ds *= 1.0f - t * t;
    dqi.axpy(ds * a.scale, kj, d, lane);
  }
  dqi.store(dq + row, d, lane, 1.0f);
}

// dk, dv for one (key row, kv head), summed over the query heads of its group and the
// queries that see it: dv_j = sum P_ij dO_i, dk_j = scale sum dS_ij q_i (with dropout
// P_ij Z_ij in dv_j).
__global__ void dkdv_kernel(AttentionArgs a, const float* __restrict__ q, const float* __restrict__ k,
                            const float* __restrict__ v, const float* __restrict__ out, const float* __restrict__ lse,
                            const float* __restrict__ dout, float* __restrict__ dk, float* __restrict__ dv) {
  const int64_t warp = blockIdx.x * static_cast<int64_t>(kWarpsPerBlock) + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (warp >= a.tokens * a.kv_heads) return;
  const int64_t j = warp / a.kv_heads, g = warp % a.kv_heads, d = a.head_dim, group = a.q_heads / a.kv_heads;
  const int64_t end = a.cu_seqlens[find_seq(a.cu_seqlens, a.num_seqs, j) + 1];
  const int64_t last = a.window > 0 ? min(end - 1, j + a.window - 1) : end - 1;
  Row kj, vj, dkj, dvj;
  kj.load(k + (j * a.kv_heads + g) * d, d, lane);
  vj.load(v + (j * a.kv_heads + g) * d, d, lane);
  dkj.zero();
  dvj.zero();
  float t = 0;
  for (int64_t h = g * group; h < (g + 1) * group; ++h)
    for (int64_t i = j; i <= last; ++i) {
      const int64_t row = (i * a.q_heads + h) * d;
      const float* qi = q + row;
      const float* doi = dout + row;
      const float p = __expf(capped(kj.dot(qi, d, lane) * a.scale, a.softcap, &t) - lse[i * a.q_heads + h]);
      // dO_i . O_i, recomputed per pair (a per-row buffer would need workspace).
      Row o;
      o.load(out + row, d, lane);
      const float delta = o.dot(doi, d, lane);
      const float z = DropoutRow(a, i * a.q_heads + h).weight(a, j);
      float ds = p * (z * vj.dot(doi, d, lane) - delta);
      if (a.softcap > 0) ds *= 1.0f - t * t;
      dvj.axpy(p * z, doi, d, lane);
      dkj.axpy(ds * a.scale, qi, d, lane);
    }
  dkj.store(dk + (j * a.kv_heads + g) * d, d, lane, 1.0f);
  dvj.store(dv + (j * a.kv_heads + g) * d, d, lane, 1.0f);
}

unsigned blocks_for_warps(int64_t warps) {
  return static_cast<unsigned>((warps + kWarpsPerBlock - 1) / kWarpsPerBlock);
}

}  // namespace

void attention_forward_f32(const ExecContext& ctx, const AttentionArgs& a, const float* q, const float* k, const float* v, float* out,
                           float* lse) {
  if (a.head_dim > kWarp * kMaxPerLane) fail("attention", "CUDA kernel supports head_dim <= {}", kWarp * kMaxPerLane);
  if (a.tokens == 0) return;
  forward_kernel<<<blocks_for_warps(a.tokens * a.q_heads), kWarp * kWarpsPerBlock, 0, stream(ctx)>>>(a, q, k, v, out, lse);
  check_launch("attention", "forward_kernel");
}

void attention_backward_f32(const ExecContext& ctx, const AttentionArgs& a, const float* q, const float* k, const float* v, const float* out,
                            const float* lse, const float* dout, float* dq, float* dk, float* dv) {
  if (a.head_dim > kWarp * kMaxPerLane) fail("attention", "CUDA kernel supports head_dim <= {}", kWarp * kMaxPerLane);
  if (a.tokens == 0) return;
  dq_kernel<<<blocks_for_warps(a.tokens * a.q_heads), kWarp * kWarpsPerBlock, 0, stream(ctx)>>>(a, q, k, v, out, lse,
                                                                                             dout, dq);
  check_launch("attention_backward", "dq_kernel");
  dkdv_kernel<<<blocks_for_warps(a.tokens * a.kv_heads), kWarp * kWarpsPerBlock, 0, stream(ctx)>>>(a, q, k, v, out, lse,
                                                                                                dout, dk, dv);
  check_launch("attention_backward", "dkdv_kernel");
}

}  // namespace kiln::cuda

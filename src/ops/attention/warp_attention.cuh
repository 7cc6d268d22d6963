// The per-warp steps of KV-cache attention with one lane per position, shared by
// warp_attention_kernel (ops/attention/cached_attention_cuda.cu) and the decoder's
// one-kernel attention (infer/decode_attention.cu). A warp takes 32 positions at a time:
// lane l scores position j0 + l against up to HT query heads held in shared memory
// (add_scores over its K row, 16 bytes at a time), the warp folds the 32 scores into its
// online softmax (fold_scores), then accumulates P V with lane l owning dims
// [l DPL, (l + 1) DPL) (accumulate_pv). Heads past nh are skipped. CUDA translation units only.
#pragma once

#include "ops/block_reduce.cuh"

#include <cuda_bf16.h>

#include <type_traits>

namespace kiln::cuda::warp_attention {

// 16 bytes of a row (8 bf16 or 4 fp32 values) as fp32.
template <typename T>
__device__ __forceinline__ void unpack(const uint4& raw, float (&out)[16 / sizeof(T)]) {
  if constexpr (std::is_same_v<T, float>) {
    out[0] = __uint_as_float(raw.x), out[1] = __uint_as_float(raw.y);
    out[2] = __uint_as_float(raw.z), out[3] = __uint_as_float(raw.w);
  } else {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 f = __bfloat1622float2(h[e]);
      out[2 * e] = f.x, out[2 * e + 1] = f.y;
    }
  }
}

// sc[t] += (query row t, elements at .. at + N - 1) . k for the first nh heads; the query
// rows are fp32 in shared memory, q_stride floats apart (read as float4 broadcasts).
template <int HT, int N>
__device__ __forceinline__ void add_scores(const float* qs, int q_stride, int at, const float (&k)[N], int nh,
                                           float (&sc)[HT]) {
  static_assert(N % 4 == 0, "scores take 4 values per shared-memory read");
#pragma unroll
  for (int t = 0; t < HT; ++t) {
    if (t >= nh) break;
#pragma unroll
    for (int e = 0; e < N; e += 4) {
      const float4 qv = *reinterpret_cast<const float4*>(qs + t * q_stride + at + e);
      sc[t] = fmaf(qv.x, k[e], sc[t]), sc[t] = fmaf(qv.y, k[e + 1], sc[t]);
      sc[t] = fmaf(qv.z, k[e + 2], sc[t]), sc[t] = fmaf(qv.w, k[e + 3], sc[t]);
    }
  }
}

// Folds each lane's score (scaled, soft-capped, -inf where the lane has no position) of the
// first nh heads into the warp's running max m, sum l and accumulators acc, and leaves the
// lane's probability in ps[t * 32 + lane] for accumulate_pv. Position j0 (lane 0) is always
// valid, so the new max is finite.
template <int HT, int DPL>
__device__ __forceinline__ void fold_scores(const float (&sc)[HT], bool valid, float scale, float softcap, int nh,
                                            float (&m)[HT], float (&l)[HT], float (&acc)[HT][DPL], float* ps) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
#pragma unroll
  for (int t = 0; t < HT; ++t) {
    if (t >= nh) break;
    float x = sc[t] * scale;
    if (softcap > 0.0f) x = tanhf(x / softcap) * softcap;
    x = valid ? x : -INFINITY;
    const float mx = fmaxf(m[t], warp_max(x));
    const float correction = expf(m[t] - mx);  // 0 while m is still -inf
    const float pj = expf(x - mx);
    l[t] = l[t] * correction + warp_sum(pj);
#pragma unroll
    for (int e = 0; e < DPL; ++e) acc[t][e] *= correction;
    ps[t * 32 + lane] = pj;
    m[t] = mx;
  }
}

// acc[t] += p(position from + i) v_i for the B V rows vf (the lane's DPL dims of positions
// from .. from + B - 1 of the round, up to count) of the first nh heads.
template <int HT, int DPL, int B>
__device__ __forceinline__ void accumulate_pv(const float* ps, int from, int count, const float (&vf)[B][DPL], int nh,
                                              float (&acc)[HT][DPL]) {
#pragma unroll
  for (int i = 0; i < B; ++i) {
    if (from + i >= count) break;
#pragma unroll
    for (int t = 0; t < HT; ++t) {
      if (t >= nh) break;
      const float pj = ps[t * 32 + from + i];
#pragma unroll
      for (int e = 0; e < DPL; ++e) acc[t][e] = fmaf(pj, vf[i][e], acc[t][e]);
    }
  }
}

}  // namespace kiln::cuda::warp_attention

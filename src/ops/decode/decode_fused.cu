// The decoder's fused GPU kernels (declared in ops/decode/decode_kernels.h). Each replaces a run
// of op front-end calls of a step with one kernel, with the same arithmetic and roundings
// as those ops' kernels (ops/rms_norm/rms_norm_bf16.cu, ops/elementwise/elementwise_cuda.cu
// and the fp32 ones): the unfused ops are the reference (DecoderOptions::fuse = false).
// At decode batch sizes these kernels are latency-bound, a few microseconds each, so
// their count, not their bytes, is what a step pays for.
#include "ops/decode/decode_kernels.h"

#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "ops/dependent_launch.cuh"
#include "ops/block_reduce.cuh"

#include <cuda_bf16.h>

#include <type_traits>

namespace kiln::cuda {

namespace {

using bf16 = __nv_bfloat16;

constexpr int kWarps = 4;              // warps per block of qkv_to_cache, one (row, head) each
constexpr int kMaxHeadDim = 512;
constexpr int kNormThreads = 256;      // add_rms_norm: one block per row

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(bf16 v) { return __bfloat162float(v); }
__device__ __forceinline__ void from_f32(float v, float* p) { *p = v; }
__device__ __forceinline__ void from_f32(float v, bf16* p) { *p = __float2bfloat16_rn(v); }
// The value a store into T and a load back would give (bf16 rounding, or none).
template <typename T>
__device__ __forceinline__ float rounded(float v) {
  if constexpr (std::is_same_v<T, bf16>) return __bfloat162float(__float2bfloat16_rn(v));
  else return v;
}


// One warp per (row, head) of the fused projection, heads ordered q, k, v as the columns
// are. Lane l holds elements c = l + 32 e. q and k: RMSNorm over the head (as
// rms_norm_forward: 1/sqrt(mean(x^2) + eps), x * inv * gain, stored, so rounded to T),
// then RoPE pairs (c, c + half) through shared memory (as rope_apply: rounded to T by the
// store). q goes to q_out, k and v to the caches at (slot, position).
template <typename T>
__global__ void __launch_bounds__(32 * kWarps)
    qkv_to_cache_kernel(const T* __restrict__ qkv, int64_t n, int64_t hq, int64_t hkv, int64_t hd,
                        const float* __restrict__ q_gain, const float* __restrict__ k_gain, float eps,
                        const float* __restrict__ cos, const float* __restrict__ sin,
                        const int32_t* __restrict__ slots, const int32_t* __restrict__ positions, int64_t max_len,
                        T* __restrict__ q_out, T* __restrict__ kc, T* __restrict__ vc) {
  __shared__ float pairs[kWarps][kMaxHeadDim];
  allow_dependents();
  wait_for_producer();
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
  const int64_t heads = hq + 2 * hkv;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  if (item >= n * heads) return;  // whole warps only: the shuffles below see full warps
  const int64_t row = item / heads, head = item - row * heads;
  const T* src = qkv + item * hd;  // row * heads * hd + head * hd
  const int64_t pos = positions[row];
  const int64_t cache_row = (static_cast<int64_t>(slots[row]) * max_len + pos) * hkv;
  if (head >= hq + hkv) {  // v: a copy into the cache
    T* dst = vc + (cache_row + head - hq - hkv) * hd;
    for (int64_t c = lane; c < hd; c += 32) dst[c] = src[c];
    return;
  }
  const bool is_q = head < hq;
  const float* gain = is_q ? q_gain : k_gain;
  float* buf = pairs[warp];
  float ss = 0.0f;
  for (int64_t c = lane; c < hd; c += 32) {
    const float v = to_f32(src[c]);
    buf[c] = v;
    ss += v * v;
  }
  if (gain != nullptr) {
    const float inv = 1.0f / sqrtf(warp_sum(ss) / static_cast<float>(hd) + eps);
    for (int64_t c = lane; c < hd; c += 32) buf[c] = rounded<T>(buf[c] * inv * gain[c]);
  }
  __syncwarp();
  T* dst = is_q ? q_out + (row * hq + head) * hd : kc + (cache_row + head - hq) * hd;
  if (cos == nullptr) {
    for (int64_t c = lane; c < hd; c += 32) from_f32(buf[c], &dst[c]);
    return;
  }
  const int64_t half = hd / 2;
  for (int64_t j = lane; j < half; j += 32) {
    const float x1 = buf[j], x2 = buf[j + half];
    const float c = cos[pos * half + j], s = sin[pos * half + j];
    from_f32(x1 * c - x2 * s, &dst[j]);
    from_f32(x2 * c + x1 * s, &dst[j + half]);
  }
}

// One block per row: x += branch (fp32 + T, as add_f32_bf16 / add_inplace_f32), then
// y = x * inv * gain with inv = 1/sqrt(mean(x^2) + eps) (as rms_norm_forward), y in T.
template <typename T>
__global__ void __launch_bounds__(kNormThreads)
    add_rms_norm_kernel(float* __restrict__ x, const T* __restrict__ branch, const float* __restrict__ gain, float eps,
                        int64_t d, T* __restrict__ y) {
  __shared__ float partial[kNormThreads / 32];
  float* xr = x + static_cast<int64_t>(blockIdx.x) * d;
  const T* br = branch ? branch + static_cast<int64_t>(blockIdx.x) * d : nullptr;
  T* yr = y + static_cast<int64_t>(blockIdx.x) * d;
  float ss = 0.0f;
  for (int64_t c = threadIdx.x; c < d; c += kNormThreads) {
    float v = xr[c];
    if (br) {
      v += to_f32(br[c]);
      xr[c] = v;
    }
    ss += v * v;
  }
  float total[1] = {ss};
  block_sum_rows<kNormThreads>(total, partial);
  const float inv = 1.0f / sqrtf(total[0] / static_cast<float>(d) + eps);
  for (int64_t c = threadIdx.x; c < d; c += kNormThreads) from_f32(xr[c] * inv * gain[c], &yr[c]);
}

template <typename T>
void launch_qkv(const ExecContext& ctx, const void* qkv, int64_t n, int64_t hq, int64_t hkv, int64_t hd, const float* q_gain,
                const float* k_gain, float eps, const float* cos, const float* sin, const int32_t* slots,
                const int32_t* positions, int64_t max_len, void* q, void* k_cache, void* v_cache) {
  const int64_t items = n * (hq + 2 * hkv);
  launch_dependent_on(stream(ctx), "decoder", "qkv_to_cache_kernel", qkv_to_cache_kernel<T>,
                   dim3(static_cast<unsigned>((items + kWarps - 1) / kWarps)), dim3(32 * kWarps), 0,
                   static_cast<const T*>(qkv), n, hq, hkv, hd, q_gain, k_gain, eps, cos, sin, slots, positions,
                   max_len, static_cast<T*>(q), static_cast<T*>(k_cache), static_cast<T*>(v_cache));
}

template <typename T>
void launch_norm(const ExecContext& ctx, float* x, const void* branch, const float* gain, float eps, int64_t n, int64_t d, void* y) {
  add_rms_norm_kernel<T><<<static_cast<unsigned>(n), kNormThreads, 0, stream(ctx)>>>(
      x, static_cast<const T*>(branch), gain, eps, d, static_cast<T*>(y));
  check_launch("decoder", "add_rms_norm_kernel");
}

}  // namespace

void qkv_to_cache(const ExecContext& ctx, DType dtype, const void* qkv, int64_t n, int64_t hq, int64_t hkv, int64_t hd, const float* q_gain,
                  const float* k_gain, float eps, const float* cos, const float* sin, const int32_t* slots,
                  const int32_t* positions, int64_t max_len, void* q, void* k_cache, void* v_cache) {
  if (n == 0) return;
  if (hd > kMaxHeadDim || (cos != nullptr && hd % 2 != 0))
    fail("decoder", "fused q/k/v kernel: head_dim {} (at most {}, even with RoPE)", hd, kMaxHeadDim);
  if (dtype == DType::bf16)
    return launch_qkv<bf16>(ctx, qkv, n, hq, hkv, hd, q_gain, k_gain, eps, cos, sin, slots, positions, max_len, q,
                            k_cache, v_cache);
  if (dtype == DType::f32)
    return launch_qkv<float>(ctx, qkv, n, hq, hkv, hd, q_gain, k_gain, eps, cos, sin, slots, positions, max_len, q,
                             k_cache, v_cache);
  fail("decoder", "fused q/k/v kernel: no {} version", dtype_name(dtype));
}

void add_rms_norm(const ExecContext& ctx, DType dtype, float* x, const void* branch, const float* gain, float eps, int64_t n, int64_t d,
                  void* y) {
  if (n == 0) return;
  if (dtype == DType::bf16) return launch_norm<bf16>(ctx, x, branch, gain, eps, n, d, y);
  if (dtype == DType::f32) return launch_norm<float>(ctx, x, branch, gain, eps, n, d, y);
  fail("decoder", "fused add + RMSNorm: no {} version", dtype_name(dtype));
}

}  // namespace kiln::cuda

// The KDA mixer's per-token kernels (declared in kda_mixer_cuda.h): correctness first,
// simple maps over elements or rows; the delta rule itself is kda_cuda.cu.
//
// Short convolution: a thread per (token, channel) finds its document by a binary search
// of cu_seqlens, so documents never read each other's rows. dx recomputes the K
// pre-activations that read each input (K <= 8, so K^2 cheap FMAs). dw: blocks of 128
// channels by a fixed number of token chunks keep K sums per channel in registers, write
// them as one partial row per chunk to the context's scratch, and a second kernel adds the
// chunks in order (same bits every run).
//
// L2 norm, output norm: a warp per (token, head) row, sums by xor butterfly (every lane
// the same bits). The output norm's gain gradient is summed as layer_norm's: each block
// owns a range of rows, its 8 warps keep column sums in shared memory, folded in warp
// order into the block's partial row, then added over blocks in order.
#include "ops/kda/kda_mixer_cuda.h"

#include "core/context_scratch.h"
#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "core/error.h"
#include "ops/ordered_partials.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>

namespace kiln::cuda {

namespace {

using bf16 = __nv_bfloat16;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kScratchFloats = int64_t{1} << 22;  // 16 MiB of partial sums per kind
constexpr ScratchKind kConvPartials{"short_conv_backward", kScratchFloats * sizeof(float)};
constexpr ScratchKind kGainPartials{"kda_output_gate_backward", kScratchFloats * sizeof(float)};

__device__ __forceinline__ float ld(const float* p) { return *p; }
__device__ __forceinline__ float ld(const bf16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ void st(float* p, float v) { *p = v; }
__device__ __forceinline__ void st(bf16* p, float v) { *p = __float2bfloat16_rn(v); }

__device__ __forceinline__ float sigmoidf(float z) {
  return z >= 0.f ? 1.f / (1.f + expf(-z)) : expf(z) / (1.f + expf(z));
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// The document holding token t: [start, end) (the last s with cu[s] <= t).
__device__ __forceinline__ int64_t doc_start(const int32_t* cu, int64_t seqs, int64_t t, int64_t& end) {
  int64_t lo = 0, hi = seqs - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (cu[mid] <= t) lo = mid; else hi = mid - 1;
  }
  end = cu[lo + 1];
  return cu[lo];
}

// The convolution before SiLU at token t (document from start), channel c; the CPU's order.
template <typename T>
__device__ __forceinline__ float conv_at(const T* x, const T* w, int64_t ch, int64_t K, int64_t start, int64_t t,
                                         int64_t c) {
  float z = 0.f;
  for (int64_t j = 0; j < K; ++j) {
    const int64_t src = t - K + 1 + j;
    if (src >= start) z += ld(w + c * K + j) * ld(x + src * ch + c);
  }
  return z;
}

// dy silu'(z), silu'(z) = s (1 + z (1 - s)).
__device__ __forceinline__ float silu_grad(float dy, float z) {
  const float s = sigmoidf(z);
  return dy * s * (1.f + z * (1.f - s));
}

template <typename T>
__global__ void conv_forward_kernel(const T* x, const T* w, const int32_t* cu, int64_t seqs, int64_t n, int64_t ch,
                                    int64_t K, T* y) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n * ch; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t = i / ch, c = i % ch;
    int64_t end;
    const float z = conv_at(x, w, ch, K, doc_start(cu, seqs, t, end), t, c);
    st(y + i, z * sigmoidf(z));
  }
}

// dx[src] = sum_j w[j] dz[src + K - 1 - j] over the tokens of src's document that read it.
template <typename T>
__global__ void conv_dx_kernel(const T* x, const T* w, const int32_t* cu, int64_t seqs, int64_t n, int64_t ch,
                               int64_t K, const T* dy, T* dx) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n * ch; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t src = i / ch, c = i % ch;
    int64_t end;
    const int64_t start = doc_start(cu, seqs, src, end);
    float sum = 0.f;
    for (int64_t j = K - 1; j >= 0; --j) {
      const int64_t t = src + K - 1 - j;
      if (t >= end) continue;
      sum += ld(w + c * K + j) * silu_grad(ld(dy + t * ch + c), conv_at(x, w, ch, K, start, t, c));
    }
    st(dx + i, sum);
  }
}

// Block (channel block, chunk): chunk b's tokens [b len, (b + 1) len) -> partials[b][c][j].
template <typename T>
__global__ void conv_dw_kernel(const T* x, const T* w, const int32_t* cu, int64_t seqs, int64_t n, int64_t ch,
                               int64_t K, const T* dy, int64_t len, float* partials) {
  const int64_t c = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (c >= ch) return;
  float acc[kShortConvMaxKernel] = {};
  const int64_t first = blockIdx.y * len, last = min(n, first + len);
  for (int64_t t = first; t < last; ++t) {
    int64_t end;
    const int64_t start = doc_start(cu, seqs, t, end);
    const float dz = silu_grad(ld(dy + t * ch + c), conv_at(x, w, ch, K, start, t, c));
#pragma unroll
    for (int64_t j = 0; j < kShortConvMaxKernel; ++j) {
      const int64_t src = t - K + 1 + j;
      if (j < K && src >= start) acc[j] += dz * ld(x + src * ch + c);
    }
  }
  for (int64_t j = 0; j < K; ++j) partials[(blockIdx.y * ch + c) * K + j] = acc[j];
}

// A warp per row (token, head, q or k): y = x / sqrt(|x|^2 + eps); v is copied.
template <typename T>
__global__ void split_norm_forward_kernel(const T* qkv, int64_t n, int64_t H, int64_t dk, int64_t dv, float eps, T* q,
                                          T* k, T* v) {
  const int lane = threadIdx.x % 32;
  const int64_t cols = H * (2 * dk + dv), rows = n * H * 2;
  const int64_t stride = int64_t{gridDim.x} * kWarps;
  for (int64_t r = blockIdx.x * int64_t{kWarps} + threadIdx.x / 32; r < rows; r += stride) {
    const int64_t part = r % 2, h = (r / 2) % H, t = r / (2 * H);
    const T* src = qkv + t * cols + part * H * dk + h * dk;
    T* dst = (part == 0 ? q : k) + (t * H + h) * dk;
    float ss = 0.f;
    for (int64_t i = lane; i < dk; i += 32) ss += ld(src + i) * ld(src + i);
    const float inv = 1.f / sqrtf(warp_sum(ss) + eps);
    for (int64_t i = lane; i < dk; i += 32) st(dst + i, ld(src + i) * inv);
    if (part == 1)
      for (int64_t i = lane; i < dv; i += 32) st(v + (t * H + h) * dv + i, ld(qkv + t * cols + 2 * H * dk + h * dv + i));
  }
}

// dx = r (dy - y (y . dy)) with y = x r; dv copied into v's columns.
template <typename T>
__global__ void split_norm_backward_kernel(const T* qkv, const T* dq, const T* dkk, const T* dvv, int64_t n,
                                           int64_t H, int64_t dk, int64_t dv, float eps, T* dqkv) {
  const int lane = threadIdx.x % 32;
  const int64_t cols = H * (2 * dk + dv), rows = n * H * 2;
  const int64_t stride = int64_t{gridDim.x} * kWarps;
  for (int64_t r = blockIdx.x * int64_t{kWarps} + threadIdx.x / 32; r < rows; r += stride) {
    const int64_t part = r % 2, h = (r / 2) % H, t = r / (2 * H);
    const int64_t at = t * cols + part * H * dk + h * dk;
    const T* dy = (part == 0 ? dq : dkk) + (t * H + h) * dk;
    float ss = 0.f, dot = 0.f;
    for (int64_t i = lane; i < dk; i += 32) ss += ld(qkv + at + i) * ld(qkv + at + i);
    const float inv = 1.f / sqrtf(warp_sum(ss) + eps);
    for (int64_t i = lane; i < dk; i += 32) dot += ld(qkv + at + i) * inv * ld(dy + i);
    dot = warp_sum(dot);
    for (int64_t i = lane; i < dk; i += 32) st(dqkv + at + i, inv * (ld(dy + i) - ld(qkv + at + i) * inv * dot));
    if (part == 1)
      for (int64_t i = lane; i < dv; i += 32) st(dqkv + t * cols + 2 * H * dk + h * dv + i, ld(dvv + (t * H + h) * dv + i));
  }
}

template <typename T>
__global__ void beta_kernel(const T* raw, const T* dbeta, int64_t count, T* out) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count; i += int64_t{gridDim.x} * blockDim.x) {
    const float s = sigmoidf(ld(raw + i));
    st(out + i, dbeta ? ld(dbeta + i) * s * (1.f - s) : s);
  }
}

// A warp per row: y = o rstd gain sigmoid(gate).
template <typename T>
__global__ void gate_forward_kernel(const T* o, const float* gain, const T* gate, int64_t rows, int64_t d, float eps,
                                    T* y) {
  const int lane = threadIdx.x % 32;
  for (int64_t r = blockIdx.x * int64_t{kWarps} + threadIdx.x / 32; r < rows; r += int64_t{gridDim.x} * kWarps) {
    const T* x = o + r * d;
    float ss = 0.f;
    for (int64_t i = lane; i < d; i += 32) ss += ld(x + i) * ld(x + i);
    const float rstd = 1.f / sqrtf(warp_sum(ss) / static_cast<float>(d) + eps);
    for (int64_t i = lane; i < d; i += 32) st(y + r * d + i, ld(x + i) * rstd * gain[i] * sigmoidf(ld(gate + r * d + i)));
  }
}

// Block b owns rows [b per, (b + 1) per); warp w takes every 8th of them. With n = o rstd,
// s = sigmoid(gate): dgate = dy n w s (1 - s), d_o = rstd (dy w s - n mean(n dy w s)),
// dgain's partial row += dy n s (shared sums[warp][i], folded in warp order).
template <typename T>
__global__ void gate_backward_kernel(const T* o, const float* gain, const T* gate, const T* dy, int64_t rows,
                                     int64_t d, float eps, int64_t per, T* d_o, T* dgate, float* partials) {
  extern __shared__ float sums[];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float* mine = sums + warp * d;
  for (int64_t i = lane; i < d; i += 32) mine[i] = 0.f;
  const int64_t begin = blockIdx.x * per, end = min(rows, begin + per);
  for (int64_t r = begin + warp; r < end; r += kWarps) {
    const T *x = o + r * d, *g = gate + r * d, *dyr = dy + r * d;
    float ss = 0.f;
    for (int64_t i = lane; i < d; i += 32) ss += ld(x + i) * ld(x + i);
    const float rstd = 1.f / sqrtf(warp_sum(ss) / static_cast<float>(d) + eps);
    float dot = 0.f;
    for (int64_t i = lane; i < d; i += 32) {
      const float nv = ld(x + i) * rstd, s = sigmoidf(ld(g + i)), dyv = ld(dyr + i);
      st(dgate + r * d + i, dyv * nv * gain[i] * s * (1.f - s));
      mine[i] += dyv * nv * s;
      dot += nv * dyv * gain[i] * s;
    }
    dot = warp_sum(dot) / static_cast<float>(d);
    for (int64_t i = lane; i < d; i += 32) {
      const float nv = ld(x + i) * rstd;
      st(d_o + r * d + i, rstd * (ld(dyr + i) * gain[i] * sigmoidf(ld(g + i)) - nv * dot));
    }
  }
  __syncthreads();
  for (int64_t i = threadIdx.x; i < d; i += blockDim.x) {
    float total = 0.f;
    for (int w = 0; w < kWarps; ++w) total += sums[w * d + i];
    partials[blockIdx.x * d + i] = total;
  }
}

template <typename Fn>
void by_dtype(DType dtype, Fn&& fn) {
  if (dtype == DType::f32) fn.template operator()<float>();
  else fn.template operator()<bf16>();
}

unsigned warp_blocks(int64_t rows) { return blocks_for(rows, kWarps); }

}  // namespace

void short_conv_forward(const ExecContext& ctx, DType dtype, const void* x, const void* w, const int32_t* cu_seqlens,
                        int64_t seqs, int64_t n, int64_t ch, int64_t kernel, void* y) {
  if (n * ch == 0) return;
  by_dtype(dtype, [&]<typename T>() {
    conv_forward_kernel<T><<<blocks_for(n * ch, kThreads), kThreads, 0, stream(ctx)>>>(
        static_cast<const T*>(x), static_cast<const T*>(w), cu_seqlens, seqs, n, ch, kernel, static_cast<T*>(y));
  });
  check_launch("short_conv_forward", "conv_forward_kernel");
}

void short_conv_backward(const ExecContext& ctx, DType dtype, const void* x, const void* w,
                         const int32_t* cu_seqlens, int64_t seqs, int64_t n, int64_t ch, int64_t kernel,
                         const void* dy, void* dx, float* dw) {
  if (n * ch == 0) return;
  const char* op = "short_conv_backward";
  KILN_CHECK(kernel <= kShortConvMaxKernel, op, "kernel {} above the GPU's {} taps", kernel, kShortConvMaxKernel);
  // Chunks depend on the shape only, so the order of dw's sums does too.
  const int64_t fit = kScratchFloats / (ch * kernel);
  KILN_CHECK(fit >= 1, op, "{} channels x {} taps exceed the partial sums' scratch", ch, kernel);
  const int64_t chunks = std::max<int64_t>(1, std::min({int64_t{64}, (n + 255) / 256, fit}));
  const int64_t len = (n + chunks - 1) / chunks;
  float* partials = dw ? context_scratch_as<float>(ctx, kConvPartials) : nullptr;
  by_dtype(dtype, [&]<typename T>() {
    const T *xp = static_cast<const T*>(x), *wp = static_cast<const T*>(w), *d = static_cast<const T*>(dy);
    conv_dx_kernel<T><<<blocks_for(n * ch, kThreads), kThreads, 0, stream(ctx)>>>(xp, wp, cu_seqlens, seqs, n, ch,
                                                                                  kernel, d, static_cast<T*>(dx));
    check_launch(op, "conv_dx_kernel");
    if (!dw) return;
    const dim3 grid(static_cast<unsigned>((ch + 127) / 128), static_cast<unsigned>(chunks));
    conv_dw_kernel<T><<<grid, 128, 0, stream(ctx)>>>(xp, wp, cu_seqlens, seqs, n, ch, kernel, d, len, partials);
    check_launch(op, "conv_dw_kernel");
    add_partials(ctx, partials, chunks, ch * kernel, dw, op);
  });
}

void kda_split_norm_forward(const ExecContext& ctx, DType dtype, const void* qkv, int64_t n, int64_t heads,
                            int64_t dk, int64_t dv, float eps, void* q, void* k, void* v) {
  if (n * heads == 0) return;
  by_dtype(dtype, [&]<typename T>() {
    split_norm_forward_kernel<T><<<warp_blocks(n * heads * 2), kThreads, 0, stream(ctx)>>>(
        static_cast<const T*>(qkv), n, heads, dk, dv, eps, static_cast<T*>(q), static_cast<T*>(k), static_cast<T*>(v));
  });
  check_launch("kda_split_norm_forward", "split_norm_forward_kernel");
}

void kda_split_norm_backward(const ExecContext& ctx, DType dtype, const void* qkv, const void* dq, const void* dk_,
                             const void* dv_, int64_t n, int64_t heads, int64_t dk, int64_t dv, float eps,
                             void* dqkv) {
  if (n * heads == 0) return;
  by_dtype(dtype, [&]<typename T>() {
    split_norm_backward_kernel<T><<<warp_blocks(n * heads * 2), kThreads, 0, stream(ctx)>>>(
        static_cast<const T*>(qkv), static_cast<const T*>(dq), static_cast<const T*>(dk_),
        static_cast<const T*>(dv_), n, heads, dk, dv, eps, static_cast<T*>(dqkv));
  });
  check_launch("kda_split_norm_backward", "split_norm_backward_kernel");
}

void kda_beta_forward(const ExecContext& ctx, DType dtype, const void* raw, int64_t count, void* beta) {
  if (count == 0) return;
  by_dtype(dtype, [&]<typename T>() {
    beta_kernel<T><<<blocks_for(count, kThreads), kThreads, 0, stream(ctx)>>>(static_cast<const T*>(raw), nullptr,
                                                                              count, static_cast<T*>(beta));
  });
  check_launch("kda_beta_forward", "beta_kernel");
}

void kda_beta_backward(const ExecContext& ctx, DType dtype, const void* raw, const void* dbeta, int64_t count,
                       void* draw) {
  if (count == 0) return;
  by_dtype(dtype, [&]<typename T>() {
    beta_kernel<T><<<blocks_for(count, kThreads), kThreads, 0, stream(ctx)>>>(
        static_cast<const T*>(raw), static_cast<const T*>(dbeta), count, static_cast<T*>(draw));
  });
  check_launch("kda_beta_backward", "beta_kernel");
}

void kda_output_gate_forward(const ExecContext& ctx, DType dtype, const void* o, const float* gain, const void* gate,
                             int64_t rows, int64_t d, float eps, void* y) {
  if (rows * d == 0) return;
  by_dtype(dtype, [&]<typename T>() {
    gate_forward_kernel<T><<<warp_blocks(rows), kThreads, 0, stream(ctx)>>>(
        static_cast<const T*>(o), gain, static_cast<const T*>(gate), rows, d, eps, static_cast<T*>(y));
  });
  check_launch("kda_output_gate_forward", "gate_forward_kernel");
}

void kda_output_gate_backward(const ExecContext& ctx, DType dtype, const void* o, const float* gain,
                              const void* gate, const void* dy, int64_t rows, int64_t d, float eps, void* d_o,
                              void* dgate, float* dgain) {
  if (rows * d == 0) return;
  const char* op = "kda_output_gate_backward";
  KILN_CHECK(d <= 1024, op, "d_v {} above the GPU kernel's 1024", d);
  // Blocks depend on the shape only: the same order of dgain's sums every run.
  const int64_t blocks = std::max<int64_t>(1, std::min({(rows + kWarps - 1) / kWarps, int64_t{1024}, kScratchFloats / d}));
  const int64_t per = (rows + blocks - 1) / blocks;
  float* partials = context_scratch_as<float>(ctx, kGainPartials);
  const size_t smem = static_cast<size_t>(kWarps * d) * sizeof(float);
  by_dtype(dtype, [&]<typename T>() {
    gate_backward_kernel<T><<<static_cast<unsigned>(blocks), kThreads, smem, stream(ctx)>>>(
        static_cast<const T*>(o), gain, static_cast<const T*>(gate), static_cast<const T*>(dy), rows, d, eps, per,
        static_cast<T*>(d_o), static_cast<T*>(dgate), partials);
  });
  check_launch(op, "gate_backward_kernel");
  add_partials(ctx, partials, blocks, d, dgain, op);
}

}  // namespace kiln::cuda

// SwiGLU on the GPU (declared in swiglu_cuda.h): gate_up [n, 2f] (gate | up) -> out [n, f]
// = silu(gate) * up, and its backward, on fp32 or bf16 data with fp32 arithmetic. One
// kernel per direction, templated on the element type T (float or bf16) and the width W:
// 8 elements per thread (16-byte bf16 accesses, two float4 of fp32) when f is a multiple
// of 8 and every pointer is 16-byte aligned, else 1 (awkward sizes, offset views). Every
// element's formula is the same for both types and widths, so the two dtypes differ only
// by the bf16 roundings at the edges. Given an `amax` (one device float), a kernel also
// leaves there the largest |value| it stored (forward: out; backward: dgate_up), as stored
// (after the bf16 rounding): what an FP8 quantize of that output would otherwise read it
// all again for (ops/fp8/fp8_linear.h).
#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "ops/bf16_vector.cuh"
#include "ops/block_reduce.cuh"
#include "ops/grid_stride.cuh"
#include "ops/swiglu/swiglu_cuda.h"

#include <cuda_bf16.h>

namespace kiln::cuda {

namespace {

using bf16 = __nv_bfloat16;
using vec::load;
using vec::store;

constexpr int kThreads = 256;

// |v| as a T stores it.
template <typename T>
__device__ __forceinline__ float stored_abs(float v) {
  T t;
  vec::from_f32(v, &t);
  return fabsf(vec::to_f32(t));
}

// *amax = max(*amax, the block's m): non-negative floats order as their bits do. Every
// thread of the block calls it (amax is the same for all of them).
__device__ __forceinline__ void block_amax(float m, float* amax) {
  if (amax == nullptr) return;
  m = block_max<kThreads>(m);
  if (threadIdx.x == 0) atomicMax(reinterpret_cast<unsigned*>(amax), __float_as_uint(m));
}

template <typename T, int W>
__global__ void swiglu_forward_kernel(const T* __restrict__ gu, int64_t n, int64_t f, T* __restrict__ out,
                                      float* amax) {
  const int64_t groups = f / W;
  float m = 0.0f;
  KILN_GRID_STRIDE(idx, n * groups) {
    const int64_t i = idx / groups, j = idx % groups * W;
    float g[W], u[W], o[W];
    load<W>(gu + i * 2 * f + j, g);
    load<W>(gu + i * 2 * f + f + j, u);
#pragma unroll
    for (int k = 0; k < W; ++k) o[k] = g[k] / (1.0f + expf(-g[k])) * u[k];
    store<W>(out + i * f + j, o);
    if (amax)
      for (int k = 0; k < W; ++k) m = fmaxf(m, stored_abs<T>(o[k]));
  }
  block_amax(m, amax);
}

// silu(g) = g s(g), s = sigmoid; d silu/dg = s (1 + g (1 - s)). out (optional; may alias
// dout, so neither is __restrict__): the forward's output again, as the forward computes it.
template <typename T, int W>
__global__ void swiglu_backward_kernel(const T* __restrict__ gu, const T* dout, int64_t n, int64_t f,
                                       T* __restrict__ dgu, T* out, float* amax) {
  const int64_t groups = f / W;
  float m = 0.0f;
  KILN_GRID_STRIDE(idx, n * groups) {
    const int64_t i = idx / groups, j = idx % groups * W;
    float g[W], u[W], dy[W], dg[W], du[W], o[W];
    load<W>(gu + i * 2 * f + j, g);
    load<W>(gu + i * 2 * f + f + j, u);
    load<W>(dout + i * f + j, dy);
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const float s = 1.0f / (1.0f + expf(-g[k]));
      dg[k] = dy[k] * u[k] * s * (1.0f + g[k] * (1.0f - s));
      du[k] = dy[k] * g[k] * s;
      o[k] = g[k] / (1.0f + expf(-g[k])) * u[k];
    }
    store<W>(dgu + i * 2 * f + j, dg);
    store<W>(dgu + i * 2 * f + f + j, du);
    if (out) store<W>(out + i * f + j, o);
    if (amax)
      for (int k = 0; k < W; ++k) m = fmaxf(m, fmaxf(stored_abs<T>(dg[k]), stored_abs<T>(du[k])));
  }
  block_amax(m, amax);
}

bool aligned16(const void* p) { return p == nullptr || vec::aligned16(p); }

// The amax starts at 0 (an empty output's amax is 0).
void zero_amax(cudaStream_t s, float* amax, const char* op) {
  if (amax) check(cudaMemsetAsync(amax, 0, sizeof(float), s), op, "cudaMemsetAsync amax");
}

template <typename T>
void forward(cudaStream_t s, const T* gu, int64_t n, int64_t f, T* out, float* amax) {
  zero_amax(s, amax, "swiglu");
  if (n * f == 0) return;
  if (f % vec::kWidth == 0 && aligned16(gu) && aligned16(out))
    swiglu_forward_kernel<T, vec::kWidth>
        <<<blocks_for(n * f / vec::kWidth, kThreads), kThreads, 0, s>>>(gu, n, f, out, amax);
  else
    swiglu_forward_kernel<T, 1><<<blocks_for(n * f, kThreads), kThreads, 0, s>>>(gu, n, f, out, amax);
  check_launch("swiglu", "swiglu_forward_kernel");
}

template <typename T>
void backward(cudaStream_t s, const T* gu, const T* dout, int64_t n, int64_t f, T* dgu, T* out, float* amax) {
  zero_amax(s, amax, "swiglu_backward");
  if (n * f == 0) return;
  if (f % vec::kWidth == 0 && aligned16(gu) && aligned16(dout) && aligned16(dgu) && aligned16(out))
    swiglu_backward_kernel<T, vec::kWidth>
        <<<blocks_for(n * f / vec::kWidth, kThreads), kThreads, 0, s>>>(gu, dout, n, f, dgu, out, amax);
  else
    swiglu_backward_kernel<T, 1><<<blocks_for(n * f, kThreads), kThreads, 0, s>>>(gu, dout, n, f, dgu, out, amax);
  check_launch("swiglu_backward", "swiglu_backward_kernel");
}

const bf16* as_bf16(const bf16_bits* p) { return reinterpret_cast<const bf16*>(p); }
bf16* as_bf16(bf16_bits* p) { return reinterpret_cast<bf16*>(p); }

}  // namespace

void swiglu_forward_f32(const ExecContext& ctx, const float* gate_up, int64_t n, int64_t f, float* out, float* amax) {
  forward(stream(ctx), gate_up, n, f, out, amax);
}

void swiglu_backward_f32(const ExecContext& ctx, const float* gate_up, const float* dout, int64_t n, int64_t f, float* dgate_up,
                         float* out, float* amax) {
  backward(stream(ctx), gate_up, dout, n, f, dgate_up, out, amax);
}

void swiglu_forward_bf16(const ExecContext& ctx, const bf16_bits* gate_up, int64_t n, int64_t f, bf16_bits* out,
                         float* amax) {
  forward(stream(ctx), as_bf16(gate_up), n, f, as_bf16(out), amax);
}

void swiglu_backward_bf16(const ExecContext& ctx, const bf16_bits* gate_up, const bf16_bits* dout, int64_t n, int64_t f,
                          bf16_bits* dgate_up, bf16_bits* out, float* amax) {
  backward(stream(ctx), as_bf16(gate_up), as_bf16(dout), n, f, as_bf16(dgate_up), out ? as_bf16(out) : nullptr, amax);
}

}  // namespace kiln::cuda

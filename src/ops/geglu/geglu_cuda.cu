// GeGLU kernels (declared in geglu_cuda.h), templated on the element type T (float or
// bf16) and the width W: 8 elements per thread (16-byte bf16 accesses, two float4 for
// fp32) when F is a multiple of 8 and every pointer is 16-byte aligned, else 1 (awkward
// sizes, offset views). fp32 math from ops/geglu/gelu_tanh.h, as the CPU reference.
#include "ops/geglu/geglu_cuda.h"

#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "core/error.h"
#include "ops/bf16_vector.cuh"
#include "ops/geglu/gelu_tanh.h"

#include <cuda_bf16.h>

#include <cstdint>

namespace kiln::cuda {

namespace {

using bf16 = __nv_bfloat16;
using vec::load;
using vec::store;

constexpr int kThreads = 256;
constexpr int kVec = vec::kWidth;

#define KILN_GRID_STRIDE(i, n)                                                                    \
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < (n); \
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)

// gate_up [n, 2f] (gate | up) -> out [n, f] = gelu_tanh(gate) * up, W columns per item.
template <typename T, int W>
__global__ void forward_kernel(const T* __restrict__ gu, int64_t n, int64_t f, T* __restrict__ out) {
  const int64_t groups = f / W;
  KILN_GRID_STRIDE(idx, n * groups) {
    const int64_t i = idx / groups, j = idx % groups * W;
    float g[W], u[W], o[W];
    load<W>(gu + i * 2 * f + j, g);
    load<W>(gu + i * 2 * f + f + j, u);
#pragma unroll
    for (int k = 0; k < W; ++k) o[k] = gelu::value(g[k]) * u[k];
    store<W>(out + i * f + j, o);
  }
}

// out (optional; may alias dout, so neither is __restrict__): the forward's output again,
// computed as forward_kernel does.
template <typename T, int W>
__global__ void backward_kernel(const T* __restrict__ gu, const T* dout, int64_t n, int64_t f, T* __restrict__ dgu,
                                T* out) {
  const int64_t groups = f / W;
  KILN_GRID_STRIDE(idx, n * groups) {
    const int64_t i = idx / groups, j = idx % groups * W;
    float g[W], u[W], dy[W], dg[W], du[W], o[W];
    load<W>(gu + i * 2 * f + j, g);
    load<W>(gu + i * 2 * f + f + j, u);
    load<W>(dout + i * f + j, dy);
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const float act = gelu::value(g[k]);
      dg[k] = dy[k] * u[k] * gelu::derivative(g[k]);
      du[k] = dy[k] * act;
      o[k] = act * u[k];
    }
    store<W>(dgu + i * 2 * f + j, dg);
    store<W>(dgu + i * 2 * f + f + j, du);
    if (out) store<W>(out + i * f + j, o);
  }
}

#undef KILN_GRID_STRIDE

bool aligned16(const void* p) { return p == nullptr || vec::aligned16(p); }

// Calls launch(T{}) with T = float or bf16 for `dtype`.
template <typename F>
void with_type(DType dtype, const char* op, F&& launch) {
  if (dtype == DType::f32) launch(float{});
  else if (dtype == DType::bf16) launch(bf16{});
  else fail(op, "no kernel for {}", dtype_name(dtype));
}

}  // namespace

void geglu_forward(const ExecContext& ctx, const void* gate_up, DType dtype, int64_t n, int64_t f, void* out) {
  if (n * f == 0) return;
  const bool vec = f % kVec == 0 && aligned16(gate_up) && aligned16(out);
  with_type(dtype, "geglu", [&](auto zero) {
    using T = decltype(zero);
    const T* gu = static_cast<const T*>(gate_up);
    T* o = static_cast<T*>(out);
    if (vec) forward_kernel<T, kVec><<<blocks_for(n * f / kVec, kThreads), kThreads, 0, stream(ctx)>>>(gu, n, f, o);
    else forward_kernel<T, 1><<<blocks_for(n * f, kThreads), kThreads, 0, stream(ctx)>>>(gu, n, f, o);
    check_launch("geglu", "forward_kernel");
  });
}

void geglu_backward(const ExecContext& ctx, const void* gate_up, const void* dout, DType dtype, int64_t n, int64_t f, void* dgate_up,
                    void* out) {
  if (n * f == 0) return;
  const bool vec = f % kVec == 0 && aligned16(gate_up) && aligned16(dout) && aligned16(dgate_up) && aligned16(out);
  with_type(dtype, "geglu_backward", [&](auto zero) {
    using T = decltype(zero);
    const T* gu = static_cast<const T*>(gate_up);
    const T* d = static_cast<const T*>(dout);
    T* dgu = static_cast<T*>(dgate_up);
    T* o = static_cast<T*>(out);
    if (vec)
      backward_kernel<T, kVec><<<blocks_for(n * f / kVec, kThreads), kThreads, 0, stream(ctx)>>>(gu, d, n, f, dgu, o);
    else
      backward_kernel<T, 1><<<blocks_for(n * f, kThreads), kThreads, 0, stream(ctx)>>>(gu, d, n, f, dgu, o);
    check_launch("geglu_backward", "backward_kernel");
  });
}

}  // namespace kiln::cuda

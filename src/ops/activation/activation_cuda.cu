// Activation kernels (declared in activation_cuda.h), templated on the element type T
// (float or bf16), the activation and the width W: 8 elements per thread (16-byte bf16
// accesses, two float4 for fp32) when the count is a multiple of 8 and every pointer is
// 16-byte aligned, else 1. fp32 math from ops/activation/activation_math.h, as the CPU
// reference. The activation is a template parameter so each kernel has no branch on it.
#include "ops/activation/activation_cuda.h"

#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "core/error.h"
#include "ops/bf16_vector.cuh"
#include "ops/grid_stride.cuh"

#include <cuda_bf16.h>

namespace kiln::cuda {

namespace {

using bf16 = __nv_bfloat16;
using activation::Kind;
using vec::load;
using vec::store;

constexpr int kThreads = 256;
constexpr int kVec = vec::kWidth;

template <typename T, Kind K, int W>
__global__ void forward_kernel(const T* __restrict__ x, int64_t groups, T* __restrict__ out) {
  KILN_GRID_STRIDE(g, groups) {
    float v[W], o[W];
    load<W>(x + g * W, v);
#pragma unroll
    for (int k = 0; k < W; ++k) o[k] = activation::value(K, v[k]);
    store<W>(out + g * W, o);
  }
}

// out (optional; may alias dout, so neither is __restrict__).
template <typename T, Kind K, int W>
__global__ void backward_kernel(const T* __restrict__ x, const T* dout, int64_t groups, T* __restrict__ dx, T* out) {
  KILN_GRID_STRIDE(g, groups) {
    float v[W], dy[W], d[W], o[W];
    load<W>(x + g * W, v);
    load<W>(dout + g * W, dy);
#pragma unroll
    for (int k = 0; k < W; ++k) {
      d[k] = dy[k] * activation::derivative(K, v[k]);
      o[k] = activation::value(K, v[k]);
    }
    store<W>(dx + g * W, d);
    if (out) store<W>(out + g * W, o);
  }
}

bool aligned16(const void* p) { return p == nullptr || vec::aligned16(p); }

// Calls launch(T{}, std::integral_constant<Kind, K>{}) for `dtype` and `kind`.
template <typename F>
void with_type(Kind kind, DType dtype, const char* op, F&& launch) {
  auto with_kind = [&](auto zero) {
    if (kind == Kind::gelu_tanh) launch(zero, std::integral_constant<Kind, Kind::gelu_tanh>{});
    else launch(zero, std::integral_constant<Kind, Kind::relu2>{});
  };
  if (dtype == DType::f32) with_kind(float{});
  else if (dtype == DType::bf16) with_kind(bf16{});
  else fail(op, "no kernel for {}", dtype_name(dtype));
}

}  // namespace

void activation_forward(const ExecContext& ctx, Kind kind, const void* x, DType dtype, int64_t count, void* out) {
  if (count == 0) return;
  const bool vec = count % kVec == 0 && aligned16(x) && aligned16(out);
  with_type(kind, dtype, activation::name(kind), [&](auto zero, auto k) {
    using T = decltype(zero);
    constexpr Kind K = decltype(k)::value;
    const T* in = static_cast<const T*>(x);
    T* o = static_cast<T*>(out);
    if (vec)
      forward_kernel<T, K, kVec><<<blocks_for(count / kVec, kThreads), kThreads, 0, stream(ctx)>>>(in, count / kVec, o);
    else forward_kernel<T, K, 1><<<blocks_for(count, kThreads), kThreads, 0, stream(ctx)>>>(in, count, o);
    check_launch(activation::name(kind), "forward_kernel");
  });
}

void activation_backward(const ExecContext& ctx, Kind kind, const void* x, const void* dout, DType dtype, int64_t count, void* dx, void* out) {
  if (count == 0) return;
  const bool vec = count % kVec == 0 && aligned16(x) && aligned16(dout) && aligned16(dx) && aligned16(out);
  with_type(kind, dtype, activation::name(kind), [&](auto zero, auto k) {
    using T = decltype(zero);
    constexpr Kind K = decltype(k)::value;
    const T* in = static_cast<const T*>(x);
    const T* d = static_cast<const T*>(dout);
    T* g = static_cast<T*>(dx);
    T* o = static_cast<T*>(out);
    if (vec)
      backward_kernel<T, K, kVec>
          <<<blocks_for(count / kVec, kThreads), kThreads, 0, stream(ctx)>>>(in, d, count / kVec, g, o);
    else backward_kernel<T, K, 1><<<blocks_for(count, kThreads), kThreads, 0, stream(ctx)>>>(in, d, count, g, o);
    check_launch(activation::name(kind), "backward_kernel");
  });
}

}  // namespace kiln::cuda

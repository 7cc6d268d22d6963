// RoPE on the GPU (declared in rope_cuda.h): x [n, heads, 2 * half] rotated in place by
// rotate_half (pairs j, j + half) with fp32 tables [positions, half], on fp32 or bf16 data
// with fp32 arithmetic. One kernel templated on the element type T (float or bf16) and the
// width W: 8 consecutive j per thread when half is a multiple of 8 and the pointers are
// 16-byte aligned, else 1. Every pair's formula is the same for both types and widths.
#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "ops/bf16_vector.cuh"
#include "ops/grid_stride.cuh"
#include "ops/rope/rope_cuda.h"

#include <cuda_bf16.h>

namespace kiln::cuda {

namespace {

using bf16 = __nv_bfloat16;
using vec::load;
using vec::store;

constexpr int kThreads = 256;

// sign = -1 applies the transposed rotation (the backward).
template <typename T, int W>
__global__ void rope_kernel(T* __restrict__ x, const int32_t* __restrict__ pos, const float* __restrict__ cos,
                            const float* __restrict__ sin, int64_t n, int64_t heads, int64_t half, float sign) {
  const int64_t groups = half / W;
  KILN_GRID_STRIDE(idx, n * heads * groups) {
    const int64_t j = idx % groups * W, row = idx / groups, i = row / heads;
    T* v = x + row * 2 * half;
    const int64_t table = static_cast<int64_t>(pos[i]) * half + j;
    float x1[W], x2[W], c[W], s[W];
    load<W>(v + j, x1);
    load<W>(v + j + half, x2);
    load<W>(cos + table, c);
    load<W>(sin + table, s);
    float o1[W], o2[W];
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const float sk = sign * s[k];
      o1[k] = x1[k] * c[k] - x2[k] * sk;
      o2[k] = x2[k] * c[k] + x1[k] * sk;
    }
    store<W>(v + j, o1);
    store<W>(v + j + half, o2);
  }
}

template <typename T>
void apply(cudaStream_t s, T* x, const int32_t* positions, const float* cos, const float* sin, int64_t n, int64_t heads, int64_t half,
           bool inverse) {
  const int64_t items = n * heads * half;
  if (items == 0) return;
  const float sign = inverse ? -1.0f : 1.0f;
  if (half % vec::kWidth == 0 && vec::aligned16(x) && vec::aligned16(cos) && vec::aligned16(sin))
    rope_kernel<T, vec::kWidth><<<blocks_for(items / vec::kWidth, kThreads), kThreads, 0, s>>>(
        x, positions, cos, sin, n, heads, half, sign);
  else
    rope_kernel<T, 1><<<blocks_for(items, kThreads), kThreads, 0, s>>>(x, positions, cos, sin, n, heads, half,
                                                                             sign);
  check_launch("rope", "rope_kernel");
}

}  // namespace

void rope_apply_f32(const ExecContext& ctx, float* x, const int32_t* positions, const float* cos, const float* sin, int64_t n, int64_t heads,
                    int64_t half, bool inverse) {
  apply(stream(ctx), x, positions, cos, sin, n, heads, half, inverse);
}

void rope_apply_bf16(const ExecContext& ctx, bf16_bits* x, const int32_t* positions, const float* cos, const float* sin, int64_t n,
                     int64_t heads, int64_t half, bool inverse) {
  apply(stream(ctx), reinterpret_cast<bf16*>(x), positions, cos, sin, n, heads, half, inverse);
}

}  // namespace kiln::cuda

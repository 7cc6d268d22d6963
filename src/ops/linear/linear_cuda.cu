// Linear layer on the GPU: cuBLASLt for the products (ops/linear/gemm_cuda.cu), small
// kernels for the bias. Activations and weights are f32, or bf16 with fp32 bias and fp32
// weight gradients (the mixed-precision path).
#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "ops/bf16_vector.cuh"
#include "ops/linear/linear_cuda.h"

#include <cuda_bf16.h>

namespace kiln::cuda {

namespace {

using vec::from_f32;
using vec::to_f32;

template <typename T>
__global__ void broadcast_rows(const float* __restrict__ bias, int64_t n, int64_t cols, T* __restrict__ y) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n * cols;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    from_f32(bias[i % cols], &y[i]);
}

// dbias[c] += sum over rows of dy[r, c]. A block per 32 columns: its 32 x kRowGroups threads
// each add every kRowGroups-th row of one column (a warp reads 32 neighbouring columns), then
// one thread per column adds the groups' sums in order. A thread per column walking all rows
// ran a few blocks on a card of 132 SMs (3.3 ms a call for the K3 model's KDA layers at
// 32,768 rows on an H100; 0.07 ms this way, docs/performance.md); this runs 32x the threads.
// The order is fixed by the launch, so the same inputs give the same bits.
constexpr int kRowGroups = 32;

template <typename T>
__global__ void __launch_bounds__(32 * kRowGroups) column_sums(const T* __restrict__ dy, int64_t n, int64_t cols,
                                                                float* __restrict__ dbias) {
  __shared__ float partial[kRowGroups][33];
  const int64_t c = blockIdx.x * int64_t{32} + threadIdx.x;
  float sum = 0;
  if (c < cols)
    for (int64_t r = threadIdx.y; r < n; r += kRowGroups) sum += to_f32(dy[r * cols + c]);
  partial[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float total = 0;
    for (int g = 0; g < kRowGroups; ++g) total += partial[g][threadIdx.x];
    dbias[c] += total;
  }
}

template <typename T>
void launch_bias(cudaStream_t stream, const float* bias, int64_t n, int64_t out, void* y) {
  broadcast_rows<<<blocks_for(n * out, 256), 256, 0, stream>>>(bias, n, out, static_cast<T*>(y));
  check_launch("linear", "broadcast_rows");
}

template <typename T>
void launch_column_sums(cudaStream_t stream, const void* dy, int64_t n, int64_t out, float* dbias) {
  const unsigned blocks = static_cast<unsigned>((out + 31) / 32);
  column_sums<<<blocks, dim3(32, kRowGroups), 0, stream>>>(static_cast<const T*>(dy), n, out, dbias);
  check_launch("linear_backward", "column_sums");
}

}  // namespace

void linear_broadcast_bias(const ExecContext& ctx, const float* bias, DType dtype, int64_t n, int64_t out, void* y) {
  dtype == DType::bf16 ? launch_bias<__nv_bfloat16>(stream(ctx), bias, n, out, y) : launch_bias<float>(stream(ctx), bias, n, out, y);
}

void linear_forward(const ExecContext& ctx, const void* x, const void* w, DType dtype, const float* bias, int64_t n, int64_t in,
                    int64_t out, void* y) {
  if (bias) linear_broadcast_bias(ctx, bias, dtype, n, out, y);
  gemm(ctx, false, true, n, out, in, 1.0f, x, in, w, in, dtype, bias ? 1.0f : 0.0f, y, out, dtype);
}

void linear_backward(const ExecContext& ctx, const void* x, const void* w, const void* dy, DType dtype, int64_t n, int64_t in, int64_t out,
                     void* dx, bool accumulate_dx, void* dw, DType dw_dtype, float* dbias) {
  if (dx) gemm(ctx, false, false, n, in, out, 1.0f, dy, out, w, in, dtype, accumulate_dx ? 1.0f : 0.0f, dx, in, dtype);
  if (dw) gemm(ctx, true, false, out, in, n, 1.0f, dy, out, x, in, dtype, 1.0f, dw, in, dw_dtype);
  if (dbias)
    dtype == DType::bf16 ? launch_column_sums<__nv_bfloat16>(stream(ctx), dy, n, out, dbias)
                         : launch_column_sums<float>(stream(ctx), dy, n, out, dbias);
}

}  // namespace kiln::cuda

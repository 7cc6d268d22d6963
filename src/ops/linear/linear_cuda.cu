// fp32 linear layer on the GPU: cuBLAS for the products, small kernels for the bias.
#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "ops/cuda_kernels.h"

namespace kiln::cuda {

namespace {

__global__ void broadcast_rows(const float* __restrict__ bias, int64_t n, int64_t cols, float* __restrict__ y) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n * cols;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    y[i] = bias[i % cols];
}

// dbias[c] += sum over rows of dy[r, c]: one thread per column, rows in order (deterministic).
__global__ void column_sums(const float* __restrict__ dy, int64_t n, int64_t cols, float* __restrict__ dbias) {
  const int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (c >= cols) return;
  float sum = 0;
  for (int64_t r = 0; r < n; ++r) sum += dy[r * cols + c];
  dbias[c] += sum;
}

}  // namespace

void linear_forward_f32(const float* x, const float* w, const float* bias, int64_t n, int64_t in, int64_t out,
                        float* y) {
  if (bias) {
    broadcast_rows<<<blocks_for(n * out, 256), 256, 0, stream()>>>(bias, n, out, y);
    check_launch("linear", "broadcast_rows");
  }
  gemm_f32(false, true, n, out, in, 1.0f, x, in, w, in, bias ? 1.0f : 0.0f, y, out);
}

void linear_backward_f32(const float* x, const float* w, const float* dy, int64_t n, int64_t in, int64_t out,
                         float* dx, bool accumulate_dx, float* dw, float* dbias) {
  if (dx) gemm_f32(false, false, n, in, out, 1.0f, dy, out, w, in, accumulate_dx ? 1.0f : 0.0f, dx, in);
  if (dw) gemm_f32(true, false, out, in, n, 1.0f, dy, out, x, in, 1.0f, dw, in);
  if (dbias) {
    column_sums<<<blocks_for(out, 256), 256, 0, stream()>>>(dy, n, out, dbias);
    check_launch("linear_backward", "column_sums");
  }
}

}  // namespace kiln::cuda

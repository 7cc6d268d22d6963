// Elementwise fp32 kernels: residual adds, SwiGLU, RoPE, the q|k|v split, and
// deterministic reductions (sum of squares, finiteness).
#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "ops/elementwise/elementwise_cuda.h"
#include "ops/rope/rope_cuda.h"
#include "ops/split/qkv_split_cuda.h"
#include "ops/swiglu/swiglu_cuda.h"
#include "ops/block_reduce.cuh"
#include "ops/grid_stride.cuh"

namespace kiln::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kReduceBlocks = 1024;

__global__ void add_kernel(const float* a, const float* b, int64_t n, float* out) {
  KILN_GRID_STRIDE(i, n) out[i] = a[i] + b[i];
}
__global__ void add_inplace_kernel(float* dst, const float* src, int64_t n) { KILN_GRID_STRIDE(i, n) dst[i] += src[i]; }
__global__ void scale_kernel(float* x, int64_t n, float factor) { KILN_GRID_STRIDE(i, n) x[i] *= factor; }

__global__ void swiglu_forward_kernel(const float* gu, int64_t n, int64_t f, float* out) {
  KILN_GRID_STRIDE(idx, n * f) {
    const int64_t i = idx / f, j = idx % f;
    const float g = gu[i * 2 * f + j], u = gu[i * 2 * f + f + j];
    out[idx] = g / (1.0f + expf(-g)) * u;
  }
}

// out (optional, may alias dout): the forward's output again.
__global__ void swiglu_backward_kernel(const float* gu, const float* dout, int64_t n, int64_t f, float* dgu,
                                       float* out) {
  KILN_GRID_STRIDE(idx, n * f) {
    const int64_t i = idx / f, j = idx % f;
    const float g = gu[i * 2 * f + j], u = gu[i * 2 * f + f + j], dy = dout[idx];
    const float s = 1.0f / (1.0f + expf(-g));
    dgu[i * 2 * f + j] = dy * u * s * (1.0f + g * (1.0f - s));
    dgu[i * 2 * f + f + j] = dy * g * s;
    if (out) out[idx] = g / (1.0f + expf(-g)) * u;
  }
}

__global__ void rope_kernel(float* x, const int32_t* pos, const float* cos, const float* sin, int64_t n, int64_t heads,
                            int64_t half, float sign) {
  KILN_GRID_STRIDE(idx, n * heads * half) {
    const int64_t j = idx % half, row = idx / half, i = row / heads;
    float* v = x + row * 2 * half;
    const float c = cos[pos[i] * half + j], s = sign * sin[pos[i] * half + j];
    const float x1 = v[j], x2 = v[j + half];
    v[j] = x1 * c - x2 * s;
    v[j + half] = x2 * c + x1 * s;
  }
}

__global__ void qkv_shuffle_kernel(float* fused, float* q, float* k, float* v, int64_t n, int64_t q_cols,
                                   int64_t kv_cols, bool to_parts) {
  const int64_t cols = q_cols + 2 * kv_cols;
  KILN_GRID_STRIDE(idx, n * cols) {
    const int64_t i = idx / cols, c = idx % cols;
    float* part = c < q_cols ? q + i * q_cols + c
                  : c < q_cols + kv_cols ? k + i * kv_cols + (c - q_cols)
                                         : v + i * kv_cols + (c - q_cols - kv_cols);
    if (to_parts)
      *part = fused[idx];
    else
      fused[idx] = *part;
  }
}

// Reductions write one partial per block into fixed device storage (no allocation),
// then one block sums the partials in index order: the same result every run.
__device__ double g_partials[kReduceBlocks];
__device__ double g_result;

__global__ void sum_squares_partial(const float* x, int64_t n) {
  double sum = 0;
  KILN_GRID_STRIDE(i, n) sum += static_cast<double>(x[i]) * x[i];
  sum = block_sum<kThreads>(sum);
  if (threadIdx.x == 0) g_partials[blockIdx.x] = sum;
}

__global__ void non_finite_partial(const float* x, int64_t n) {
  double bad = 0;
  KILN_GRID_STRIDE(i, n) bad += isfinite(x[i]) ? 0.0 : 1.0;
  bad = block_sum<kThreads>(bad);  // whole numbers: exact in any order
  if (threadIdx.x == 0) g_partials[blockIdx.x] = bad;
}

__global__ void sum_partials(int blocks, double* out) {
  double total = 0;
  for (int b = 0; b < blocks; ++b) total += g_partials[b];
  *out = total;
}

// The partials, then their sum into `out` (device memory): nothing waits for it.
template <typename Kernel>
void reduce_into(Kernel kernel, const float* x, int64_t n, const char* op, double* out) {
  const int blocks = static_cast<int>(std::min<int64_t>(kReduceBlocks, (n + kThreads - 1) / kThreads + 1));
  kernel<<<blocks, kThreads, 0, stream()>>>(x, n);
  check_launch(op, "partial");
  sum_partials<<<1, 1, 0, stream()>>>(blocks, out);
  check_launch(op, "sum_partials");
}

template <typename Kernel>
double reduce(Kernel kernel, const float* x, int64_t n, const char* op) {
  void* result_on_device = nullptr;
  check(cudaGetSymbolAddress(&result_on_device, g_result), op, "cudaGetSymbolAddress");
  reduce_into(kernel, x, n, op, static_cast<double*>(result_on_device));
  double result = 0;
  check(cudaMemcpyAsync(&result, result_on_device, sizeof(double), cudaMemcpyDeviceToHost, stream()), op,
        "copy result");
  check(cudaStreamSynchronize(stream()), op, "synchronize");
  return result;
}

}  // namespace

#define KILN_LAUNCH(op, kernel, n, ...)                                            \
  do {                                                                             \
    kernel<<<blocks_for((n), kThreads), kThreads, 0, stream()>>>(__VA_ARGS__);     \
    check_launch(op, #kernel);                                                     \
  } while (0)

void add_f32(const float* a, const float* b, int64_t n, float* out) { KILN_LAUNCH("add", add_kernel, n, a, b, n, out); }
void add_inplace_f32(float* dst, const float* src, int64_t n) {
  KILN_LAUNCH("add_inplace", add_inplace_kernel, n, dst, src, n);
}
void scale_inplace_f32(float* x, int64_t n, float factor) { KILN_LAUNCH("scale_inplace", scale_kernel, n, x, n, factor); }
void swiglu_forward_f32(const float* gu, int64_t n, int64_t f, float* out) {
  KILN_LAUNCH("swiglu", swiglu_forward_kernel, n * f, gu, n, f, out);
}
void swiglu_backward_f32(const float* gu, const float* dout, int64_t n, int64_t f, float* dgu, float* out) {
  KILN_LAUNCH("swiglu_backward", swiglu_backward_kernel, n * f, gu, dout, n, f, dgu, out);
}
void rope_apply_f32(float* x, const int32_t* positions, const float* cos, const float* sin, int64_t n, int64_t heads,
                    int64_t half, bool inverse) {
  KILN_LAUNCH("rope", rope_kernel, n * heads * half, x, positions, cos, sin, n, heads, half, inverse ? -1.0f : 1.0f);
}
void qkv_shuffle_f32(float* fused, float* q, float* k, float* v, int64_t n, int64_t q_cols, int64_t kv_cols,
                     bool to_parts) {
  KILN_LAUNCH("qkv_split", qkv_shuffle_kernel, n * (q_cols + 2 * kv_cols), fused, q, k, v, n, q_cols, kv_cols, to_parts);
}
double sum_squares_f32(const float* x, int64_t n) { return reduce(sum_squares_partial, x, n, "sum_squares"); }
void sum_squares_to_device_f32(const float* x, int64_t n, double* out) {
  reduce_into(sum_squares_partial, x, n, "sum_squares", out);
}
bool all_finite_f32(const float* x, int64_t n) { return reduce(non_finite_partial, x, n, "all_finite") == 0.0; }

}  // namespace kiln::cuda

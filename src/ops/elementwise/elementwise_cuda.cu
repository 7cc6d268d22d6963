// Elementwise kernels of the residual stream (declared in elementwise_cuda.h): the adds,
// scaling, the fp32 <-> bf16 casts, and the deterministic reductions of gradient norms and
// finiteness checks.
//
// The add and the casts have two shapes, chosen per call: W = 8 elements per thread
// (16-byte bf16 accesses, two float4 of fp32) when every pointer is 16-byte aligned, else
// W = 1 (offset views); a tail of fewer than 8 elements goes one per thread. The add is one
// kernel for fp32 and bf16 branches (the mixed path's fp32 + bf16 -> fp32): the same
// formula, only the branch's load differs.
#include "core/context_scratch.h"
#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "ops/bf16_vector.cuh"
#include "ops/block_reduce.cuh"
#include "ops/elementwise/elementwise_cuda.h"
#include "ops/grid_stride.cuh"

#include <cuda_bf16.h>

namespace kiln::cuda {

namespace {

using bf16 = __nv_bfloat16;
using vec::aligned16;
using vec::load;
using vec::store;

constexpr int kThreads = 256;
constexpr int kVec = vec::kWidth;
constexpr int kReduceBlocks = 1024;

// out = a + b with b fp32 or bf16; out may alias a (each thread reads its elements before
// it writes them).
template <typename B, int W>
__global__ void add_kernel(const float* a, const B* __restrict__ b, int64_t n, float* out) {
  const int64_t body = n / W * W;
  KILN_GRID_STRIDE(i, body / W) {
    float x[W], y[W];
    load<W>(a + i * W, x);
    load<W>(b + i * W, y);
#pragma unroll
    for (int k = 0; k < W; ++k) x[k] += y[k];
    store<W>(out + i * W, x);
  }
  KILN_GRID_STRIDE(i, n - body) out[body + i] = a[body + i] + vec::to_f32(b[body + i]);
}

__global__ void add_inplace_kernel(float* dst, const float* src, int64_t n) { KILN_GRID_STRIDE(i, n) dst[i] += src[i]; }
__global__ void add_inplace_bf16_kernel(bf16* dst, const bf16* src, int64_t n) {
  KILN_GRID_STRIDE(i, n) vec::from_f32(vec::to_f32(dst[i]) + vec::to_f32(src[i]), &dst[i]);
}
__global__ void scale_kernel(float* x, int64_t n, float factor) { KILN_GRID_STRIDE(i, n) x[i] *= factor; }

// dst = src converted (fp32 -> bf16 rounds to nearest even; bf16 -> fp32 is exact). The
// first n / W * W elements go in vectors, the rest (fewer than 8) one per thread.
template <typename From, typename To, int W>
__global__ void convert_kernel(const From* __restrict__ src, int64_t n, To* __restrict__ dst) {
  const int64_t body = n / W * W;
  KILN_GRID_STRIDE(i, body / W) {
    float v[W];
    load<W>(src + i * W, v);
    store<W>(dst + i * W, v);
  }
  KILN_GRID_STRIDE(i, n - body) {
    float v[1];
    load<1>(src + body + i, v);
    store<1>(dst + body + i, v);
  }
}

// Reductions write one partial per block into the context's device scratch
// (core/context_scratch.h; no allocation after the first call), then one block sums the
// partials in index order: the same result every run. The slot after the partials holds
// the result that reduce() copies to the host.
constexpr ScratchKind kReduceScratch{"reduction", (kReduceBlocks + 1) * sizeof(double)};

__global__ void sum_squares_partial(const float* x, int64_t n, double* partials) {
  double sum = 0;
  KILN_GRID_STRIDE(i, n) sum += static_cast<double>(x[i]) * x[i];
  sum = block_sum<kThreads>(sum);
  if (threadIdx.x == 0) partials[blockIdx.x] = sum;
}

__global__ void non_finite_partial(const float* x, int64_t n, double* partials) {
  double bad = 0;
  KILN_GRID_STRIDE(i, n) bad += isfinite(x[i]) ? 0.0 : 1.0;
  bad = block_sum<kThreads>(bad);  // whole numbers: exact in any order
  if (threadIdx.x == 0) partials[blockIdx.x] = bad;
}

__global__ void sum_partials(const double* partials, int blocks, double* out) {
  double total = 0;
  for (int b = 0; b < blocks; ++b) total += partials[b];
  *out = total;
}

// The partials, then their sum into `out` (device memory): nothing waits for it.
template <typename Kernel>
void reduce_into(const ExecContext& ctx, Kernel kernel, const float* x, int64_t n, const char* op, double* out) {
  const int blocks = static_cast<int>(std::min<int64_t>(kReduceBlocks, (n + kThreads - 1) / kThreads + 1));
  double* const partials = context_scratch_as<double>(ctx, kReduceScratch);
  const cudaStream_t s = stream(ctx);
  kernel<<<blocks, kThreads, 0, s>>>(x, n, partials);
  check_launch(op, "partial");
  sum_partials<<<1, 1, 0, s>>>(partials, blocks, out);
  check_launch(op, "sum_partials");
}

template <typename Kernel>
double reduce(const ExecContext& ctx, Kernel kernel, const float* x, int64_t n, const char* op) {
  double* const result_on_device = context_scratch_as<double>(ctx, kReduceScratch) + kReduceBlocks;
  reduce_into(ctx, kernel, x, n, op, result_on_device);
  const cudaStream_t s = stream(ctx);
  double result = 0;
  check(cudaMemcpyAsync(&result, result_on_device, sizeof(double), cudaMemcpyDeviceToHost, s), op, "copy result");
  check(cudaStreamSynchronize(s), op, "synchronize");
  return result;
}

#define KILN_LAUNCH(s, op, kernel, n, ...)                                         \
  do {                                                                             \
    kernel<<<blocks_for((n), kThreads), kThreads, 0, (s)>>>(__VA_ARGS__);          \
    check_launch(op, #kernel);                                                     \
  } while (0)

template <typename B>
void add(cudaStream_t s, const float* a, const B* b, int64_t n, float* out, const char* op) {
  if (n == 0) return;
  // The vector kernel's grid covers the n / 8 vectors; its tail of < 8 elements needs one block.
  if (aligned16(a) && aligned16(b) && aligned16(out))
    add_kernel<B, kVec><<<blocks_for(n / kVec, kThreads), kThreads, 0, s>>>(a, b, n, out);
  else
    add_kernel<B, 1><<<blocks_for(n, kThreads), kThreads, 0, s>>>(a, b, n, out);
  check_launch(op, "add_kernel");
}

template <typename From, typename To>
void convert(cudaStream_t s, const From* src, int64_t n, To* dst, const char* op) {
  if (n == 0) return;
  if (aligned16(src) && aligned16(dst))
    convert_kernel<From, To, kVec><<<blocks_for(n / kVec, kThreads), kThreads, 0, s>>>(src, n, dst);
  else
    convert_kernel<From, To, 1><<<blocks_for(n, kThreads), kThreads, 0, s>>>(src, n, dst);
  check_launch(op, "convert_kernel");
}

}  // namespace

void add_f32(const ExecContext& ctx, const float* a, const float* b, int64_t n, float* out) {
  add(stream(ctx), a, b, n, out, "add");
}
void add_f32_bf16(const ExecContext& ctx, const float* a, const bf16_bits* b, int64_t n, float* out) {
  add(stream(ctx), a, reinterpret_cast<const bf16*>(b), n, out, "add_f32_bf16");
}
void add_inplace_f32(const ExecContext& ctx, float* dst, const float* src, int64_t n) {
  KILN_LAUNCH(stream(ctx), "add_inplace", add_inplace_kernel, n, dst, src, n);
}
void add_inplace_bf16(const ExecContext& ctx, bf16_bits* dst, const bf16_bits* src, int64_t n) {
  KILN_LAUNCH(stream(ctx), "add_inplace", add_inplace_bf16_kernel, n, reinterpret_cast<bf16*>(dst),
              reinterpret_cast<const bf16*>(src), n);
}
void scale_inplace_f32(const ExecContext& ctx, float* x, int64_t n, float factor) {
  KILN_LAUNCH(stream(ctx), "scale_inplace", scale_kernel, n, x, n, factor);
}

void cast_f32_to_bf16(const ExecContext& ctx, const float* src, int64_t n, bf16_bits* dst) {
  convert(stream(ctx), src, n, reinterpret_cast<bf16*>(dst), "cast_f32_to_bf16");
}
void cast_bf16_to_f32(const ExecContext& ctx, const bf16_bits* src, int64_t n, float* dst) {
  convert(stream(ctx), reinterpret_cast<const bf16*>(src), n, dst, "cast_bf16_to_f32");
}

void zero_bytes(const ExecContext& ctx, void* dst, size_t bytes) {
  check(cudaMemsetAsync(dst, 0, bytes, stream(ctx)), "zero", "cudaMemsetAsync");
}

void copy_bytes(const ExecContext& ctx, const void* src, size_t bytes, void* dst) {
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream(ctx)), "convert", "cudaMemcpyAsync");
}

double sum_squares_f32(const ExecContext& ctx, const float* x, int64_t n) {
  return reduce(ctx, sum_squares_partial, x, n, "sum_squares");
}
void sum_squares_to_device_f32(const ExecContext& ctx, const float* x, int64_t n, double* out) {
  reduce_into(ctx, sum_squares_partial, x, n, "sum_squares", out);
}
bool all_finite_f32(const ExecContext& ctx, const float* x, int64_t n) {
  return reduce(ctx, non_finite_partial, x, n, "all_finite") == 0.0;
}

}  // namespace kiln::cuda

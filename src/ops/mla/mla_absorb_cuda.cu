// The absorbed products of MLA decode on the GPU (declared in mla_absorb_cuda.h). Written
// as one block per (row, head) rather than as strided-batched cuBLASLt products: each
// head's matrix starts d or r elements after the last, strides cuBLASLt's heuristic
// assumes 256-byte aligned, and these are decode-sized products (rows x heads x d x r
// multiply-adds, a few MFLOP) where correctness, not speed, is the first need.
#include "ops/mla/mla_absorb_cuda.h"

#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "core/error.h"
#include "ops/bf16_vector.cuh"
#include "ops/block_reduce.cuh"

#include <cuda_bf16.h>

namespace kiln::cuda {

namespace {

using bf16 = __nv_bfloat16;
using vec::from_f32;
using vec::to_f32;

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / kWarpSize;

// Block (n, h): q_h into shared memory, then thread a (strided) sums over the head's d
// rows of w_kb; consecutive threads read consecutive columns of a row (coalesced).
template <typename T>
__global__ void absorb_query_kernel(const T* __restrict__ q, int64_t heads, int64_t d, const T* __restrict__ w,
                                    int64_t r, T* __restrict__ out) {
  extern __shared__ float q_head[];
  const int64_t nh = blockIdx.x, h = nh % heads;
  for (int64_t i = threadIdx.x; i < d; i += blockDim.x) q_head[i] = to_f32(q[nh * d + i]);
  __syncthreads();
  const T* w_head = w + h * d * r;
  for (int64_t a = threadIdx.x; a < r; a += blockDim.x) {
    float acc = 0.0f;
    for (int64_t i = 0; i < d; ++i) acc += q_head[i] * to_f32(w_head[i * r + a]);
    from_f32(acc, out + nh * r + a);
  }
}

// Block (n, h): cbar_h into shared memory, then a warp per output column j (strided) takes
// the dot of w_vb's row h d + j with it, lanes over the row (coalesced), a warp sum.
template <typename T>
__global__ void expand_values_kernel(const T* __restrict__ cbar, int64_t heads, int64_t r, const T* __restrict__ w,
                                     int64_t d, T* __restrict__ out) {
  extern __shared__ float c_head[];
  const int64_t nh = blockIdx.x, h = nh % heads;
  for (int64_t a = threadIdx.x; a < r; a += blockDim.x) c_head[a] = to_f32(cbar[nh * r + a]);
  __syncthreads();
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize, lane = static_cast<int>(threadIdx.x) % kWarpSize;
  for (int64_t j = warp; j < d; j += kWarps) {
    const T* row = w + (h * d + j) * r;
    float acc = 0.0f;
    for (int64_t a = lane; a < r; a += kWarpSize) acc += to_f32(row[a]) * c_head[a];
    acc = warp_sum(acc);
    if (lane == 0) from_f32(acc, out + nh * d + j);
  }
}

}  // namespace

void mla_absorb_query(const ExecContext& ctx, DType dtype, const void* q, int64_t rows, int64_t heads, int64_t d,
                      const void* w_kb, int64_t r, void* q_abs) {
  if (rows * heads * r == 0) return;
  const unsigned blocks = static_cast<unsigned>(rows * heads);
  const size_t smem = sizeof(float) * static_cast<size_t>(d);
  if (dtype == DType::f32)
    absorb_query_kernel<float><<<blocks, kThreads, smem, stream(ctx)>>>(
        static_cast<const float*>(q), heads, d, static_cast<const float*>(w_kb), r, static_cast<float*>(q_abs));
  else if (dtype == DType::bf16)
    absorb_query_kernel<bf16><<<blocks, kThreads, smem, stream(ctx)>>>(
        static_cast<const bf16*>(q), heads, d, static_cast<const bf16*>(w_kb), r, static_cast<bf16*>(q_abs));
  else
    fail("mla_absorb_query", "the GPU computes in f32 or bf16, got {}", dtype_name(dtype));
  check_launch("mla_absorb_query", "absorb_query_kernel");
}

void mla_expand_values(const ExecContext& ctx, DType dtype, const void* cbar, int64_t rows, int64_t heads, int64_t r,
                       const void* w_vb, int64_t d, void* o) {
  if (rows * heads * d == 0) return;
  const unsigned blocks = static_cast<unsigned>(rows * heads);
  const size_t smem = sizeof(float) * static_cast<size_t>(r);
  if (dtype == DType::f32)
    expand_values_kernel<float><<<blocks, kThreads, smem, stream(ctx)>>>(
        static_cast<const float*>(cbar), heads, r, static_cast<const float*>(w_vb), d, static_cast<float*>(o));
  else if (dtype == DType::bf16)
    expand_values_kernel<bf16><<<blocks, kThreads, smem, stream(ctx)>>>(
        static_cast<const bf16*>(cbar), heads, r, static_cast<const bf16*>(w_vb), d, static_cast<bf16*>(o));
  else
    fail("mla_expand_values", "the GPU computes in f32 or bf16, got {}", dtype_name(dtype));
  check_launch("mla_expand_values", "expand_values_kernel");
}

}  // namespace kiln::cuda

// QK-Clip's kernels (qk_clip_cuda.h): the same fp32 arithmetic as the CPU reference, the
// products rounded on their own (no fused multiply-add), so both devices give the same bits.
#include "ops/attention/qk_clip_cuda.h"

#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "ops/attention/logit_key.h"
#include "ops/grid_stride.cuh"
#include "ops/optim/adamw_lowmem_math.h"

namespace kiln::cuda {

namespace {

constexpr int kThreads = 256;

__device__ float clip_gamma(uint32_t key, float tau) {
  if (key == 0) return 1.0f;  // no logit yet
  const float max = __uint_as_float(kiln::ops::logit_bits_of_key(key));
  return max > tau ? __fdiv_rn(tau, max) : 1.0f;
}

// One block: the heads in turn (a handful of values).
__global__ void factors_kernel(const uint32_t* __restrict__ keys, int64_t q_heads, int64_t kv_heads, float tau,
                               int sharing, float* __restrict__ q_factors, float* __restrict__ k_factors) {
  if (threadIdx.x != 0) return;
  if (sharing == 2) {
    float least = 1.0f;
    for (int64_t h = 0; h < q_heads; ++h) least = fminf(least, clip_gamma(keys[h], tau));
    q_factors[0] = k_factors[0] = __fsqrt_rn(least);
    return;
  }
  for (int64_t h = 0; h < q_heads; ++h) {
    const float gamma = clip_gamma(keys[h], tau);
    q_factors[h] = sharing == 0 ? __fsqrt_rn(gamma) : gamma;
    if (sharing == 0) k_factors[h] = q_factors[h];
  }
  if (sharing == 1)
    for (int64_t g = 0; g < kv_heads; ++g) k_factors[g] = 1.0f;
}

__global__ void scale_rows_kernel(float* __restrict__ w, int64_t rows, int64_t cols, const float* __restrict__ factors,
                                  int64_t head_dim, bool single, bool gain_offset) {
  KILN_GRID_STRIDE(i, rows * cols) {
    const float f = factors[single ? 0 : (i / cols) / head_dim];
    const float x = w[i];
    w[i] = gain_offset ? __fsub_rn(__fmul_rn(__fadd_rn(1.0f, x), f), 1.0f) : __fmul_rn(x, f);
  }
}

__global__ void scale_rows_bf16_kernel(uint16_t* __restrict__ w, int64_t rows, int64_t cols,
                                       const float* __restrict__ factors, int64_t head_dim, bool single) {
  KILN_GRID_STRIDE(i, rows * cols) {
    const float f = factors[single ? 0 : (i / cols) / head_dim];
    w[i] = adamw_lowmem::to_bf16(__fmul_rn(adamw_lowmem::from_bf16(w[i]), f));
  }
}

}  // namespace

void scale_head_rows_bf16(const ExecContext& ctx, uint16_t* weight, int64_t rows, int64_t cols, const float* factors,
                          int64_t head_dim, bool single) {
  const int64_t n = rows * cols;
  if (n == 0) return;
  scale_rows_bf16_kernel<<<blocks_for(n, kThreads), kThreads, 0, stream(ctx)>>>(weight, rows, cols, factors, head_dim,
                                                                             single);
  check_launch("scale_head_rows", "scale_rows_bf16_kernel");
}

void qk_clip_factors(const ExecContext& ctx, const uint32_t* keys, int64_t q_heads, int64_t kv_heads, float tau, int sharing,
                     float* q_factors, float* k_factors) {
  factors_kernel<<<1, 32, 0, stream(ctx)>>>(keys, q_heads, kv_heads, tau, sharing, q_factors, k_factors);
  check_launch("qk_clip_factors", "factors_kernel");
}

void scale_head_rows(const ExecContext& ctx, float* weight, int64_t rows, int64_t cols, const float* factors, int64_t head_dim, bool single,
                     bool gain_offset) {
  const int64_t n = rows * cols;
  if (n == 0) return;
  scale_rows_kernel<<<blocks_for(n, kThreads), kThreads, 0, stream(ctx)>>>(weight, rows, cols, factors, head_dim, single,
                                                                        gain_offset);
  check_launch("scale_head_rows", "scale_rows_kernel");
}

}  // namespace kiln::cuda

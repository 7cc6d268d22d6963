// fp32 cross-entropy over a chunk of LM-head logits, one block per row, in place: the row
// becomes its own gradient so the chunk buffer feeds the dh/dw GEMMs directly.
#include "core/context_scratch.h"
#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "ops/block_reduce.cuh"
#include "ops/cross_entropy/cross_entropy_cuda.h"

namespace kiln::cuda {

namespace {

constexpr int kThreads = 256;

__global__ void rows_kernel(float* logits, int64_t stride, const int32_t* targets, int64_t vocab, float z_loss,
                            LossScale scale, float cap, bool grad, double* stats) {
  const int64_t row = blockIdx.x;
  float* x = logits + row * stride;  // the first vocab columns: the padding is never read
  const int32_t target = targets[row];
  if (target < 0) {
    if (grad)
      for (int64_t j = threadIdx.x; j < vocab; j += kThreads) x[j] = 0;
    if (threadIdx.x == 0) stats[2 * row] = stats[2 * row + 1] = 0;
    return;
  }
  float local_max = -INFINITY;
  for (int64_t j = threadIdx.x; j < vocab; j += kThreads) {
    if (cap > 0) x[j] = cap * tanhf(x[j] / cap);
    local_max = fmaxf(local_max, x[j]);
  }
  const float m = block_max<kThreads>(local_max);
  float local_sum = 0;
  for (int64_t j = threadIdx.x; j < vocab; j += kThreads) local_sum += __expf(x[j] - m);
  const float lse = m + logf(block_sum<kThreads>(local_sum));
  const float target_logit = x[target];
  __syncthreads();  // every thread has read x[target] before the row is overwritten
  if (threadIdx.x == 0) {
    stats[2 * row] = static_cast<double>(lse) - target_logit;
    stats[2 * row + 1] = static_cast<double>(lse) * lse;
  }
  if (!grad) return;
  const float zfactor = 1.0f + 2.0f * z_loss * lse;
  const float loss_scale = scale.get();
  for (int64_t j = threadIdx.x; j < vocab; j += kThreads) {
    float g = __expf(x[j] - lse) * zfactor - (j == target ? 1.0f : 0.0f);
    if (cap > 0) {
      const float t = x[j] / cap;
      g *= 1.0f - t * t;
    }
    x[j] = g * loss_scale;
  }
}

__global__ void softcap_kernel(float* x, int64_t n, float cap) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    x[i] = cap * tanhf(x[i] / cap);
}

// Loss, z and count of the current lm_head_loss call when it was given no sums of its own.
constexpr ScratchKind kOwnSums{"lm_head_loss", 3 * sizeof(double)};

double* sums_or_own(const ExecContext& ctx, double* sums) {
  return sums != nullptr ? sums : context_scratch_as<double>(ctx, kOwnSums);
}

__global__ void sums_reset_kernel(double* sums) { sums[0] = sums[1] = sums[2] = 0; }

// One block: thread t sums rows t, t + kSumThreads, ... in order, then the threads' partial
// sums meet in a fixed tree. The partition depends only on `rows`, so the sums are the same
// every run (not the CPU's row-order sums: an fp64 rounding apart). One thread walking the
// rows took about a microsecond per row (a dependent chain through global memory).
constexpr int kSumThreads = 1024;

__global__ void __launch_bounds__(kSumThreads)
    sums_accumulate_kernel(double* __restrict__ sums, const double* __restrict__ stats,
                           const int32_t* __restrict__ targets, int64_t rows) {
  __shared__ double partial[3][kSumThreads];
  double loss = 0, z = 0, count = 0;
  for (int64_t r = threadIdx.x; r < rows; r += kSumThreads) {
    if (targets[r] < 0) continue;
    loss += stats[2 * r];
    z += stats[2 * r + 1];
    count += 1;
  }
  partial[0][threadIdx.x] = loss, partial[1][threadIdx.x] = z, partial[2][threadIdx.x] = count;
  __syncthreads();
  for (int stride = kSumThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride)
      for (int k = 0; k < 3; ++k) partial[k][threadIdx.x] += partial[k][threadIdx.x + stride];
    __syncthreads();
  }
  if (threadIdx.x == 0)
    for (int k = 0; k < 3; ++k) sums[k] += partial[k][0];
}

}  // namespace

void loss_sums_reset(const ExecContext& ctx, double* sums) {
  sums_reset_kernel<<<1, 1, 0, stream(ctx)>>>(sums_or_own(ctx, sums));
  check_launch("lm_head_loss", "sums_reset_kernel");
}

void loss_sums_accumulate(const ExecContext& ctx, double* sums, const double* row_stats, const int32_t* targets, int64_t rows) {
  if (rows == 0) return;
  sums_accumulate_kernel<<<1, kSumThreads, 0, stream(ctx)>>>(sums_or_own(ctx, sums), row_stats, targets, rows);
  check_launch("lm_head_loss", "sums_accumulate_kernel");
}

void loss_sums_read(const ExecContext& ctx, const double* sums, double* loss, double* z, int64_t* count) {
  double host[3];
  check(cudaMemcpyAsync(host, sums_or_own(ctx, const_cast<double*>(sums)), sizeof(host), cudaMemcpyDeviceToHost, stream(ctx)),
        "lm_head_loss", "copy sums");
  check(cudaStreamSynchronize(stream(ctx)), "lm_head_loss", "synchronize");
  *loss = host[0];
  *z = host[1];
  *count = static_cast<int64_t>(host[2]);
}

void cross_entropy_rows_f32(const ExecContext& ctx, float* logits, int64_t stride, const int32_t* targets, int64_t rows,
                            int64_t vocab, float z_loss, LossScale loss_scale, float softcap, bool grad, double* row_stats) {
  if (rows == 0) return;
  rows_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream(ctx)>>>(logits, stride, targets, vocab, z_loss,
                                                                      loss_scale, softcap, grad, row_stats);
  check_launch("lm_head_loss", "rows_kernel");
}

void softcap_f32(const ExecContext& ctx, float* x, int64_t n, float cap) {
  softcap_kernel<<<blocks_for(n, kThreads), kThreads, 0, stream(ctx)>>>(x, n, cap);
  check_launch("lm_head_logits", "softcap_kernel");
}

}  // namespace kiln::cuda

#include "ops/gemma_rms_norm/gemma_gain_cuda.h"

#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "ops/grid_stride.cuh"

namespace kiln::cuda {

namespace {

__global__ void gain_kernel(const float* __restrict__ w, int64_t count, float* __restrict__ gain) {
  KILN_GRID_STRIDE(i, count) gain[i] = 1.0f + w[i];
}

}  // namespace

void gemma_gain(const ExecContext& ctx, const float* w, int64_t count, float* gain) {
  if (count == 0) return;
  constexpr int kThreads = 256;
  gain_kernel<<<blocks_for(count, kThreads), kThreads, 0, stream(ctx)>>>(w, count, gain);
  check_launch("gemma_gain", "gain_kernel");
}

}  // namespace kiln::cuda

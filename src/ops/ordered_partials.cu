#include "ops/ordered_partials.h"

#include "core/cuda_check.h"
#include "core/cuda_context.h"

namespace kiln::cuda {

namespace {

constexpr int kThreads = 256;

__global__ void add_partials_kernel(const float* partials, int64_t parts, int64_t cols, float* out) {
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < cols; e += int64_t{gridDim.x} * blockDim.x) {
    float total = 0.f;
    for (int64_t b = 0; b < parts; ++b) total += partials[b * cols + e];
    out[e] += total;
  }
}

}  // namespace

void add_partials(const ExecContext& ctx, const float* partials, int64_t parts, int64_t cols, float* out,
                  const char* op) {
  add_partials_kernel<<<blocks_for(cols, kThreads), kThreads, 0, stream(ctx)>>>(partials, parts, cols, out);
  check_launch(op, "add_partials_kernel");
}

}  // namespace kiln::cuda

// Embedding rows on the GPU (declared in embedding_cuda.h): the forward copies table rows,
// the backward adds output rows into the table's gradient, with atomics (any order) or by
// groups of equal ids (one fixed order, no atomics).
#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "ops/embedding/embedding_cuda.h"
#include "ops/grid_stride.cuh"

namespace kiln::cuda {

namespace {

constexpr int kThreads = 256;

__global__ void embedding_forward_kernel(const int32_t* tokens, const float* table, int64_t n, int64_t dim, float* out) {
  KILN_GRID_STRIDE(idx, n * dim) out[idx] = table[static_cast<int64_t>(tokens[idx / dim]) * dim + idx % dim];
}

__global__ void embedding_forward_bf16_table_kernel(const int32_t* tokens, const uint16_t* table, int64_t n,
                                                   int64_t dim, float* out) {
  KILN_GRID_STRIDE(idx, n * dim) {
    const uint16_t h = table[static_cast<int64_t>(tokens[idx / dim]) * dim + idx % dim];
    out[idx] = __uint_as_float(static_cast<uint32_t>(h) << 16);  // exact: bf16 widens to fp32
  }
}

__global__ void embedding_backward_kernel(const int32_t* tokens, const float* dout, int64_t n, int64_t dim, float* dt) {
  KILN_GRID_STRIDE(idx, n * dim) atomicAdd(&dt[static_cast<int64_t>(tokens[idx / dim]) * dim + idx % dim], dout[idx]);
}

// Block per group of equal token ids, threads over columns: each column of the table row
// is one thread's sum over the group's rows in their original order.
__global__ void embedding_backward_grouped_kernel(const int32_t* order, const int32_t* group_tokens,
                                                  const int32_t* group_starts, const float* dout, int64_t dim,
                                                  float* dtable) {
  const int64_t g = blockIdx.x;
  const int32_t begin = group_starts[g], end = group_starts[g + 1];
  if (begin == end) return;  // padding of a static grid (a captured step's groups)
  float* row = dtable + static_cast<int64_t>(group_tokens[g]) * dim;
  for (int64_t c = threadIdx.x; c < dim; c += blockDim.x) {
    float sum = 0;
    for (int32_t r = begin; r < end; ++r) sum += dout[static_cast<int64_t>(order[r]) * dim + c];
    row[c] += sum;
  }
}

}  // namespace

void embedding_forward_f32(const ExecContext& ctx, const int32_t* tokens, const float* table, int64_t n, int64_t dim, float* out) {
  embedding_forward_kernel<<<blocks_for(n * dim, kThreads), kThreads, 0, stream(ctx)>>>(tokens, table, n, dim, out);
  check_launch("embedding", "embedding_forward_kernel");
}

void embedding_forward_bf16_table(const ExecContext& ctx, const int32_t* tokens, const uint16_t* table, int64_t n,
                                  int64_t dim, float* out) {
  embedding_forward_bf16_table_kernel<<<blocks_for(n * dim, kThreads), kThreads, 0, stream(ctx)>>>(tokens, table, n,
                                                                                                   dim, out);
  check_launch("embedding", "embedding_forward_bf16_table_kernel");
}

void embedding_backward_f32(const ExecContext& ctx, const int32_t* tokens, const float* dout, int64_t n, int64_t dim, float* dtable) {
  embedding_backward_kernel<<<blocks_for(n * dim, kThreads), kThreads, 0, stream(ctx)>>>(tokens, dout, n, dim, dtable);
  check_launch("embedding_backward", "embedding_backward_kernel");
}

void embedding_backward_grouped_f32(const ExecContext& ctx, const int32_t* order, const int32_t* group_tokens, const int32_t* group_starts,
                                    int64_t groups, const float* dout, int64_t dim, float* dtable) {
  if (groups == 0) return;
  embedding_backward_grouped_kernel<<<static_cast<unsigned>(groups), 256, 0, stream(ctx)>>>(order, group_tokens,
                                                                                         group_starts, dout, dim, dtable);
  check_launch("embedding_backward", "embedding_backward_grouped_kernel");
}

}  // namespace kiln::cuda

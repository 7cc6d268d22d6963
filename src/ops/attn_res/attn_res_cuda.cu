// Block Attention Residuals' mix on the GPU (attn_res_cuda.h; the math as the CPU
// reference, ops/attn_res/attn_res.cpp). One block of kThreads per row (forward) or per
// run of rows (backward): per source a block sum of the squares and of w . V_s, then one
// thread forms the scores, the softmax and the per-source factors in shared memory, and
// every thread walks its columns once more. The query's gradient sums over rows: each
// backward block writes one row of per-column partials, which a second kernel adds in a
// fixed order (ops/column_sums.cuh). No atomics: the same bits every run.
#include "ops/attn_res/attn_res_cuda.h"

#include "core/context_scratch.h"
#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "core/error.h"
#include "ops/block_reduce.cuh"
#include "ops/column_sums.cuh"

#include <algorithm>
#include <cmath>

namespace kiln::cuda {

namespace {

constexpr const char* kOp = "attn_res_mix";
constexpr int kThreads = 256;
constexpr int kMaxSources = kAttnResMaxSources;
// Backward blocks at most. Each walks its rows one after another (3 block sums per source
// per row), so the rows per block set its time: 512 blocks left 64 rows each at 32,768 rows
// (1.5 ms a call on an H100 at seed 001's K3 shape); 2,048 fill the card with 16.
constexpr int64_t kMaxPartialRows = 2048;
constexpr int64_t kScratchFloats = int64_t{1} << 21;  // dw partials: [blocks, cols]
constexpr ScratchKind kPartials{"attn_res_mix_backward", kScratchFloats * sizeof(float)};
constexpr int kSumSlices = 16;

// The sources' row pointers travel by value in the kernel's parameters (no device array to
// fill: nothing to allocate or copy inside a captured step).
struct Sources {
  const float* v[kMaxSources];
  float* dv[kMaxSources];
};

// Per-row values shared by the block: the softmax weights, 1 / rms and the scores.
struct RowWeights {
  float a[kMaxSources], inv_rms[kMaxSources], z[kMaxSources];
};

// Row r's weights into `row` (every thread of the block calls it; all see the result).
__device__ void row_weights(const Sources& src, int n, const float* __restrict__ w, int64_t r, int64_t cols, float eps,
                            RowWeights& row) {
  for (int s = 0; s < n; ++s) {
    const float* v = src.v[s] + r * cols;
    float squares = 0.0f, dot = 0.0f;
    for (int64_t c = threadIdx.x; c < cols; c += kThreads) {
      const float x = v[c];
      squares += x * x;
      dot += w[c] * x;
    }
    squares = block_sum<kThreads>(squares);  // block_sum syncs first: the previous row's reads are done
    dot = block_sum<kThreads>(dot);
    if (threadIdx.x == 0) {
      const float inv_rms = 1.0f / sqrtf(squares / static_cast<float>(cols) + eps);
      row.inv_rms[s] = inv_rms;
      row.z[s] = dot * inv_rms;
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float top = -INFINITY;
    for (int s = 0; s < n; ++s) top = fmaxf(top, row.z[s]);
    float total = 0.0f;
    for (int s = 0; s < n; ++s) total += (row.a[s] = expf(row.z[s] - top));
    for (int s = 0; s < n; ++s) row.a[s] /= total;
  }
  __syncthreads();
}

__global__ void __launch_bounds__(kThreads) forward_kernel(Sources src, int n, const float* __restrict__ w, float eps,
                                                           int64_t cols, float* __restrict__ out) {
  __shared__ RowWeights row;
  const int64_t r = blockIdx.x;
  row_weights(src, n, w, r, cols, eps, row);
  for (int64_t c = threadIdx.x; c < cols; c += kThreads) {
    float sum = 0.0f;
    for (int s = 0; s < n; ++s) sum += row.a[s] * src.v[s][r * cols + c];
    out[r * cols + c] = sum;
  }
}

// With g_s = dout . V_s: dz_s = a_s (g_s - sum_r a_r g_r), f_s = dz_s / rms_s;
// dV_s += a_s dout + f_s (w - V_s z_s / (rms_s C)); the row's dw term sum_s f_s V_s goes to
// this block's partial row.
__global__ void __launch_bounds__(kThreads) backward_kernel(Sources src, int n, const float* __restrict__ w, float eps,
                                                            const float* __restrict__ dout, int64_t rows, int64_t cols,
                                                            int64_t rows_per_block, float* __restrict__ partials) {
  __shared__ RowWeights row;
  __shared__ float f[kMaxSources];
  float* const dw = partials + blockIdx.x * cols;
  const int64_t first = blockIdx.x * rows_per_block, last = min(rows, first + rows_per_block);
  for (int64_t c = threadIdx.x; c < cols; c += kThreads) dw[c] = 0.0f;
  for (int64_t r = first; r < last; ++r) {
    row_weights(src, n, w, r, cols, eps, row);
    const float* g = dout + r * cols;
    for (int s = 0; s < n; ++s) {
      const float* v = src.v[s] + r * cols;
      float dot = 0.0f;
      for (int64_t c = threadIdx.x; c < cols; c += kThreads) dot += g[c] * v[c];
      dot = block_sum<kThreads>(dot);
      if (threadIdx.x == 0) f[s] = dot;  // g_s for now
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      float mean = 0.0f;
      for (int s = 0; s < n; ++s) mean += row.a[s] * f[s];
      for (int s = 0; s < n; ++s) f[s] = row.a[s] * (f[s] - mean) * row.inv_rms[s];
    }
    __syncthreads();
    const float inv_cols = 1.0f / static_cast<float>(cols);
    for (int64_t c = threadIdx.x; c < cols; c += kThreads) {
      const float gc = g[c], wc = w[c];
      float term = 0.0f;
      for (int s = 0; s < n; ++s) {
        const float vs = src.v[s][r * cols + c];
        src.dv[s][r * cols + c] += row.a[s] * gc + f[s] * (wc - vs * row.inv_rms[s] * row.z[s] * inv_cols);
        term += f[s] * vs;
      }
      dw[c] += term;
    }
  }
}

__global__ void __launch_bounds__(kColumnSumCols* kSumSlices)
    column_sum_kernel(const float* __restrict__ partials, int64_t blocks, int64_t cols, float* __restrict__ dquery) {
  const int64_t c = blockIdx.x * static_cast<int64_t>(kColumnSumCols) + threadIdx.x;
  float total;
  if (!column_total<kSumSlices>(partials, blocks, cols, c, total)) return;
  dquery[c] += total;
}

Sources sources_of(const float* const* v, float* const* dv, int n) {
  KILN_CHECK(n >= 1 && n <= kMaxSources, kOp, "{} sources: the GPU mix takes 1 to {}", n, kMaxSources);
  Sources s{};
  for (int i = 0; i < n; ++i) {
    s.v[i] = v[i];
    s.dv[i] = dv ? dv[i] : nullptr;
  }
  return s;
}

}  // namespace

void attn_res_mix_forward(const ExecContext& ctx, const float* const* sources, int n, const float* query, float eps,
                          int64_t rows, int64_t cols, float* out) {
  if (rows == 0 || cols == 0) return;
  KILN_CHECK(rows <= 0x7fffffff, kOp, "{} rows", rows);
  const Sources src = sources_of(sources, nullptr, n);
  forward_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream(ctx)>>>(src, n, query, eps, cols, out);
  check_launch(kOp, "forward_kernel");
}

void attn_res_mix_backward(const ExecContext& ctx, const float* const* sources, int n, const float* query, float eps,
                           const float* dout, int64_t rows, int64_t cols, float* const* dsources, float* dquery) {
  if (rows == 0 || cols == 0) return;
  KILN_CHECK(cols <= kScratchFloats, kOp, "{} columns exceed the query gradient's scratch", cols);
  const Sources src = sources_of(sources, dsources, n);
  float* const partials = context_scratch_as<float>(ctx, kPartials);
  // As many blocks as the scratch holds (at most kMaxPartialRows), the rows spread evenly.
  int64_t blocks = std::min({rows, kMaxPartialRows, kScratchFloats / cols});
  const int64_t rows_per_block = (rows + blocks - 1) / blocks;
  blocks = (rows + rows_per_block - 1) / rows_per_block;
  backward_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream(ctx)>>>(src, n, query, eps, dout, rows, cols,
                                                                              rows_per_block, partials);
  check_launch(kOp, "backward_kernel");
  column_sum_kernel<<<static_cast<unsigned>((cols + kColumnSumCols - 1) / kColumnSumCols), dim3(kColumnSumCols, kSumSlices), 0,
                      stream(ctx)>>>(partials, blocks, cols, dquery);
  check_launch(kOp, "column_sum_kernel");
}

}  // namespace kiln::cuda

// DyT kernels (declared in dyt_cuda.h).
//
// Forward: one thread per element (no statistics, nothing to reduce).
// Backward: block b owns a contiguous run of rows. Its threads form `slices` groups of
// `lanes` threads (lanes: the columns rounded up to a power of two, 32 to kThreads): a lane
// takes a column (a warp reads 32 consecutive elements of a row), a slice every slices-th row
// of the block's run. Narrow rows (the q/k norm's heads of 64 or 128) so keep every thread
// of the block busy; rows of kThreads or more columns have one slice, whose lanes stride
// over the columns. Each thread keeps its dw/db partials in registers; the slices' partials
// are added in slice order through shared memory, and the block's row of partials goes to
// the context's device scratch (core/context_scratch.h), with its dalpha partial. A second
// kernel adds the blocks' rows in a fixed order (ops/column_sums.cuh), so the same inputs
// give the same bits every run, with no allocation after the first call and no host
// synchronization (safe under CUDA-graph capture). Each stream has its own scratch and its
// calls run one after another, so two calls never share it at once.
#include "ops/dyt/dyt_cuda.h"

#include "core/context_scratch.h"
#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "core/error.h"
#include "ops/bf16_vector.cuh"
#include "ops/column_sums.cuh"
#include "ops/grid_stride.cuh"
#include "ops/row_group_sum.cuh"

#include <cuda_bf16.h>

#include <algorithm>

namespace kiln::cuda {

namespace {

using bf16 = __nv_bfloat16;
using vec::from_f32;
using vec::to_f32;

constexpr const char* kOp = "dyt_backward";
constexpr int kThreads = 256;
constexpr int64_t kMaxPartialRows = 512;         // blocks of the backward at most
constexpr int64_t kScratchFloats = int64_t{1} << 21;  // dw|db partials: [blocks, 2 cols]

// The dw|db partial rows, then the blocks' dalpha partials.
constexpr ScratchKind kPartials{"dyt_backward", (kScratchFloats + kMaxPartialRows) * sizeof(float)};

template <typename TX, typename TY>
__global__ void forward_kernel(const TX* __restrict__ x, const float* __restrict__ alpha, const float* __restrict__ w,
                               const float* __restrict__ b, int64_t rows, int64_t cols, TY* __restrict__ y) {
  const float a = *alpha;
  KILN_GRID_STRIDE(i, rows * cols) {
    const int64_t c = i % cols;
    const float t = tanhf(a * to_f32(x[i]));
    from_f32(t * (w ? w[c] : 1.0f) + (b ? b[c] : 0.0f), y + i);
  }
}

template <typename TX, typename TY>
__global__ void __launch_bounds__(kThreads)
    backward_kernel(const TX* __restrict__ x, const float* __restrict__ alpha, const float* __restrict__ w,
                    const TY* __restrict__ dy, int64_t rows, int64_t cols, int64_t rows_per_block, int lanes,
                    TX* __restrict__ dx, bool accumulate, TY* __restrict__ dx_copy, float* __restrict__ partials) {
  __shared__ float slice_dw[kThreads], slice_db[kThreads];
  const float a = *alpha;
  const int lane = static_cast<int>(threadIdx.x) % lanes, slice = static_cast<int>(threadIdx.x) / lanes;
  const int slices = kThreads / lanes;
  const int64_t r0 = blockIdx.x * rows_per_block, r1 = min(rows, r0 + rows_per_block);
  float* partial = partials + blockIdx.x * 2 * cols;
  float alpha_sum = 0.0f;
  // Every thread takes the same number of turns (the barriers below need all of them).
  for (int64_t c0 = 0; c0 < cols; c0 += lanes) {
    const int64_t c = c0 + lane;
    float dw = 0.0f, db = 0.0f;
    if (c < cols) {
      const float wc = w ? w[c] : 1.0f;
      for (int64_t r = r0 + slice; r < r1; r += slices) {
        const int64_t i = r * cols + c;
        const float xv = to_f32(x[i]), g = to_f32(dy[i]);
        const float t = tanhf(a * xv), slope = 1.0f - t * t;
        float d = g * wc * a * slope;
        if (accumulate) d += to_f32(dx[i]);
        from_f32(d, dx + i);
        if (dx_copy) from_f32(d, dx_copy + i);
        alpha_sum += g * wc * xv * slope;
        dw += g * t;
        db += g;
      }
    }
    if (slices > 1) {  // the slices' partials of column c, added in slice order
      slice_dw[threadIdx.x] = dw, slice_db[threadIdx.x] = db;
      __syncthreads();
      if (slice == 0) {
        for (int s = 1; s < slices; ++s) dw += slice_dw[s * lanes + lane], db += slice_db[s * lanes + lane];
      }
      __syncthreads();  // before the next turn overwrites the slots
    }
    if (partials && slice == 0 && c < cols) partial[c] = dw, partial[cols + c] = db;
  }
  const float total = row_group_sum<kThreads>(alpha_sum);
  if (partials && threadIdx.x == 0) partials[kScratchFloats + blockIdx.x] = total;
}

// The lanes per slice of the backward for rows of `cols` columns: the power of two covering
// them, at least a warp and at most the block.
int lanes_for(int64_t cols) {
  int lanes = 32;
  while (lanes < kThreads && lanes < cols) lanes *= 2;
  return lanes;
}

// Column c of the partial rows [blocks, 2 cols] (dw's columns, then db's), in a fixed order.
constexpr int kSumSlices = 16;

__global__ void __launch_bounds__(kColumnSumCols* kSumSlices)
    column_sum_kernel(const float* __restrict__ partials, int64_t blocks, int64_t cols, float* __restrict__ dw,
                      float* __restrict__ db) {
  const int64_t c = blockIdx.x * static_cast<int64_t>(kColumnSumCols) + threadIdx.x;
  float total;
  if (!column_total<kSumSlices>(partials, blocks, 2 * cols, c, total)) return;
  if (c < cols) {
    if (dw) dw[c] += total;
  } else if (db) {
    db[c - cols] += total;
  }
}

// dalpha += the blocks' partials, in a fixed order (one block).
__global__ void __launch_bounds__(kThreads) alpha_sum_kernel(const float* __restrict__ partials, int64_t blocks,
                                                                  float* __restrict__ dalpha) {
  float sum = 0.0f;
  for (int64_t b = threadIdx.x; b < blocks; b += kThreads) sum += partials[kScratchFloats + b];
  const float total = row_group_sum<kThreads>(sum);
  if (threadIdx.x == 0) *dalpha += total;
}

// Calls launch(TX{}, TY{}) for the dtypes: (f32, f32), (f32, bf16), (bf16, bf16).
template <typename F>
void dispatch(DType x_dtype, DType y_dtype, const char* op, F&& launch) {
  if (x_dtype == DType::f32 && y_dtype == DType::f32) launch(float{}, float{});
  else if (x_dtype == DType::f32 && y_dtype == DType::bf16) launch(float{}, bf16{});
  else if (x_dtype == DType::bf16 && y_dtype == DType::bf16) launch(bf16{}, bf16{});
  else fail(op, "no kernel for x {} and y {}", dtype_name(x_dtype), dtype_name(y_dtype));
}

}  // namespace

void dyt_forward(const ExecContext& ctx, const void* x, DType x_dtype, const float* alpha, const float* w, const float* b, int64_t rows,
                 int64_t cols, void* y, DType y_dtype) {
  if (rows * cols == 0) return;
  dispatch(x_dtype, y_dtype, "dyt", [&](auto tx, auto ty) {
    using TX = decltype(tx);
    using TY = decltype(ty);
    forward_kernel<TX, TY><<<blocks_for(rows * cols, kThreads), kThreads, 0, stream(ctx)>>>(
        static_cast<const TX*>(x), alpha, w, b, rows, cols, static_cast<TY*>(y));
    check_launch("dyt", "forward_kernel");
  });
}

void dyt_backward(const ExecContext& ctx, const void* x, DType x_dtype, const float* alpha, const float* w, const void* dy, DType y_dtype,
                  int64_t rows, int64_t cols, void* dx, bool accumulate_dx, float* dalpha, float* dw, float* db,
                  void* dx_copy) {
  if (rows == 0 || cols == 0) return;
  KILN_CHECK(2 * cols <= kScratchFloats, kOp, "{} columns exceed the gain/bias gradient scratch", cols);
  float* const partials = dalpha || dw || db ? context_scratch_as<float>(ctx, kPartials) : nullptr;
  // As many blocks as the scratch holds (at most kMaxPartialRows), the rows spread evenly.
  int64_t blocks = std::min({rows, kMaxPartialRows, kScratchFloats / (2 * cols)});
  const int64_t rows_per_block = (rows + blocks - 1) / blocks;
  blocks = (rows + rows_per_block - 1) / rows_per_block;
  dispatch(x_dtype, y_dtype, kOp, [&](auto tx, auto ty) {
    using TX = decltype(tx);
    using TY = decltype(ty);
    backward_kernel<TX, TY><<<static_cast<unsigned>(blocks), kThreads, 0, stream(ctx)>>>(
        static_cast<const TX*>(x), alpha, w, static_cast<const TY*>(dy), rows, cols, rows_per_block, lanes_for(cols),
        static_cast<TX*>(dx), accumulate_dx, static_cast<TY*>(dx_copy), partials);
    check_launch(kOp, "backward_kernel");
  });
  if (dw || db) {
    column_sum_kernel<<<blocks_for(2 * cols, kColumnSumCols), dim3(kColumnSumCols, kSumSlices), 0, stream(ctx)>>>(
        partials, blocks, cols, dw, db);
    check_launch(kOp, "column_sum_kernel");
  }
  if (dalpha) {
    alpha_sum_kernel<<<1, kThreads, 0, stream(ctx)>>>(partials, blocks, dalpha);
    check_launch(kOp, "alpha_sum_kernel");
  }
}

}  // namespace kiln::cuda

// LayerNorm kernels (declared in layer_norm_cuda.h), templated on the load/store types:
// TX for x, dx and the fused sum (fp32, or bf16), TY for y, dy, the fused branch and the dx
// copy (fp32 on the fp32 path, bf16 on the mixed path). All arithmetic is fp32.
//
// Rows map to groups of kThreads threads inside 256-thread blocks: 8 or 16 threads for
// short rows (up to 64 or 128 columns in vectors of 8), a warp for rows up to 1024, the
// whole block above that. Rows whose length is a multiple of 8 with 16-byte aligned
// pointers move 8 elements per access; any other row takes the scalar path.
//
// Forward: three passes over the row (sum for the mean, squared deviations for the
// variance, then the output), the same two-pass statistics as the CPU reference, so a
// large mean does not cancel the variance away. Each group sum reduces in a fixed order.
//
// Backward: dw = sum dy * xhat and db = sum dy over rows are fused into the dx kernel, as
// in rms_norm_bf16.cu: each block owns a contiguous range of rows, its groups keep running
// column sums in shared memory, the block folds its groups in order into one row of
// partial sums in the context's device scratch (core/context_scratch.h), and a second
// kernel adds the partial rows column by column in a fixed order before one `+=` per
// column. The block count depends only on the shape and the path, so dw and db are the same
// bits every run; no atomics, no allocation after the first call, no host synchronization
// (safe under CUDA-graph capture). Each stream has its own scratch, and the calls on one
// stream run one after another, so two calls never share it at once.
#include "ops/layer_norm/layer_norm_cuda.h"

#include "core/context_scratch.h"
#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "core/error.h"
#include "ops/bf16_vector.cuh"
#include "ops/column_sums.cuh"
#include "ops/row_group_sum.cuh"

#include <cuda_bf16.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <type_traits>

namespace kiln::cuda {

namespace {

using bf16 = __nv_bfloat16;
using vec::load;
using vec::store;

constexpr const char* kOp = "layer_norm";
constexpr int kWarp = 32;
constexpr int kBlockThreads = 256;
constexpr int kVec = vec::kWidth;

// Partial column sums of the backward: at most kMaxPartialRows rows (one per block) of
// (dw, db) x cols floats, 16 MiB in all; long rows get fewer blocks so that they fit.
constexpr int64_t kMaxPartialRows = 2048;
constexpr int64_t kScratchFloats = int64_t{1} << 22;
constexpr ScratchKind kPartials{"layer_norm_backward", kScratchFloats * sizeof(float)};

bool aligned16(const void* p) { return p == nullptr || vec::aligned16(p); }

// W values of an fp32 parameter vector from column c, or `fill` without one.
template <int W>
__device__ __forceinline__ void load_or(const float* p, int64_t c, float fill, float (&v)[W]) {
  if (p) {
    load<W>(p + c, v);
  } else {
#pragma unroll
    for (int k = 0; k < W; ++k) v[k] = fill;
  }
}

// The row's input at column `at`: x, or with a branch (the fused residual add) x + branch.
template <int W, typename TX, typename TY>
__device__ __forceinline__ void load_input(const TX* xr, const TY* br, int64_t at, float (&v)[W]) {
  load<W>(xr + at, v);
  if (br) {
    float b[W];
    load<W>(br + at, b);
#pragma unroll
    for (int k = 0; k < W; ++k) v[k] += b[k];
  }
}

// ---- kernels ----------------------------------------------------------------------------

// One group per row, kBlockThreads / kThreads rows per block. With a branch, sum = x +
// branch is normalized and written to `sum` by the first pass.
template <typename TX, typename TY, int kThreads, int W>
__global__ void __launch_bounds__(kBlockThreads)
    forward_kernel(const TX* __restrict__ x, const TY* __restrict__ branch, float* __restrict__ sum,
                   const float* __restrict__ w, const float* __restrict__ b, float eps, int64_t rows, int64_t cols,
                   TY* __restrict__ y, float* __restrict__ mean, float* __restrict__ rstd) {
  constexpr int kRows = kBlockThreads / kThreads;
  const int t = static_cast<int>(threadIdx.x % kThreads);
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRows + threadIdx.x / kThreads;
  const bool valid = row < rows;  // groups past the last row still join the shuffles
  const int64_t vecs = valid ? cols / W : 0;
  const int64_t offset = (valid ? row : 0) * cols;
  const TX* xr = x + offset;
  const TY* br = branch ? branch + offset : nullptr;
  const float inv_cols = 1.0f / static_cast<float>(cols);

  float total = 0.0f;
  for (int64_t i = t; i < vecs; i += kThreads) {
    float v[W];
    load_input<W>(xr, br, i * W, v);
    if (br) store<W>(sum + offset + i * W, v);
#pragma unroll
    for (int k = 0; k < W; ++k) total += v[k];
  }
  const float mu = row_group_sum<kThreads>(total) * inv_cols;

  float squares = 0.0f;
  for (int64_t i = t; i < vecs; i += kThreads) {
    float v[W];
    load_input<W>(xr, br, i * W, v);
#pragma unroll
    for (int k = 0; k < W; ++k) squares += (v[k] - mu) * (v[k] - mu);
  }
  const float inv = 1.0f / sqrtf(row_group_sum<kThreads>(squares) * inv_cols + eps);
  if (valid && t == 0) mean[row] = mu, rstd[row] = inv;

  for (int64_t i = t; i < vecs; i += kThreads) {
    float v[W], g[W], bias[W], out[W];
    load_input<W>(xr, br, i * W, v);
    load_or<W>(w, i * W, 1.0f, g);
    load_or<W>(b, i * W, 0.0f, bias);
#pragma unroll
    for (int k = 0; k < W; ++k) out[k] = (v[k] - mu) * inv * g[k] + bias[k];
    store<W>(y + offset + i * W, out);
  }
}

// dx = r * (g - mean(g) - xhat * mean(g * xhat)) with xhat = (x - mean) * r, g = dy * w;
// `=` or `+=` by accumulate. With dw / db sums (with_dw, with_db), also this block's
// partial column sums of dy * xhat and dy (see the top). Block b owns rows
// [b * rows_per_block, ...); its kRows groups take them kRows at a time, every group running
// the same number of iterations (the shuffles and barriers need all).
template <typename TX, typename TY, int kThreads, int W>
__global__ void __launch_bounds__(kBlockThreads)
    backward_kernel(const TX* __restrict__ x, const float* __restrict__ w, const float* __restrict__ mean,
                    const float* __restrict__ rstd, const TY* __restrict__ dy, int64_t rows, int64_t cols,
                    int64_t rows_per_block, TX* __restrict__ dx, bool accumulate, TY* __restrict__ dx_copy,
                    bool with_dw, bool with_db, float* __restrict__ partials) {
  constexpr int kRows = kBlockThreads / kThreads;
  // Per group: the dw sums (if with_dw), then the db sums (if with_db), cols floats each.
  // Column i * W + k sits at [k * (cols / W) + i]: for each k a warp touches consecutive
  // words (no bank conflicts), and each slot belongs to one thread.
  extern __shared__ float column_sums[];
  const int64_t sums = int64_t{with_dw} + int64_t{with_db};
  const int64_t db_at = with_dw ? cols : 0;
  const int t = static_cast<int>(threadIdx.x % kThreads);
  const int group = static_cast<int>(threadIdx.x / kThreads);
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * rows_per_block;
  const int64_t end = begin + rows_per_block < rows ? begin + rows_per_block : rows;
  const int64_t iterations = (end - begin + kRows - 1) / kRows;
  const int64_t stride = cols / W;
  const float inv_cols = 1.0f / static_cast<float>(cols);
  float* my_sums = column_sums + group * sums * cols;
  // Each thread zeroes the slots it alone adds to below (no barrier is needed between).
  for (int64_t i = t; i < stride; i += kThreads)
    for (int64_t part = 0; part < sums; ++part)
#pragma unroll
      for (int k = 0; k < W; ++k) my_sums[part * cols + k * stride + i] = 0.0f;

  for (int64_t it = 0; it < iterations; ++it) {
    const int64_t row = begin + it * kRows + group;
    const bool valid = row < end;
    const int64_t vecs = valid ? stride : 0;
    const int64_t offset = (valid ? row : 0) * cols;
    const TX* xr = x + offset;
    const TY* gr = dy + offset;
    const float mu = valid ? mean[row] : 0.0f, inv = valid ? rstd[row] : 0.0f;

    float sum_g = 0.0f, sum_gx = 0.0f;
    for (int64_t i = t; i < vecs; i += kThreads) {
      float v[W], d[W], s[W];
      load<W>(xr + i * W, v);
      load<W>(gr + i * W, d);
      load_or<W>(w, i * W, 1.0f, s);
#pragma unroll
      for (int k = 0; k < W; ++k) {
        const float g = d[k] * s[k];
        sum_g += g;
        sum_gx += g * ((v[k] - mu) * inv);
      }
    }
    sum_g = row_group_sum<kThreads>(sum_g);
    sum_gx = row_group_sum<kThreads>(sum_gx);
    if (!valid) continue;
    const float mean_g = sum_g * inv_cols, mean_gx = sum_gx * inv_cols;

    for (int64_t i = t; i < vecs; i += kThreads) {
      float v[W], d[W], s[W], out[W];
      load<W>(xr + i * W, v);
      load<W>(gr + i * W, d);
      load_or<W>(w, i * W, 1.0f, s);
#pragma unroll
      for (int k = 0; k < W; ++k) {
        const float xhat = (v[k] - mu) * inv;
        out[k] = inv * (d[k] * s[k] - mean_g - xhat * mean_gx);
        if (with_dw) my_sums[k * stride + i] += d[k] * xhat;
        if (with_db) my_sums[db_at + k * stride + i] += d[k];
      }
      if (accumulate) {
        float old[W];
        load<W>(dx + offset + i * W, old);
#pragma unroll
        for (int k = 0; k < W; ++k) out[k] = old[k] + out[k];
      }
      store<W>(dx + offset + i * W, out);
      if (dx_copy) store<W>(dx_copy + offset + i * W, out);
    }
  }
  if (sums == 0) return;

  __syncthreads();  // every group's sums are complete
  float* partial = partials + static_cast<int64_t>(blockIdx.x) * sums * cols;
  for (int64_t c = threadIdx.x; c < cols; c += kBlockThreads) {
    const int64_t slot = c % W * stride + c / W;
    for (int64_t part = 0; part < sums; ++part) {
      float total = 0.0f;
      for (int g = 0; g < kRows; ++g) total += column_sums[(g * sums + part) * cols + slot];
      partial[part * cols + c] = total;
    }
  }
}

// Column c of the partial rows [blocks, sums * cols], summed in a fixed order
// (ops/column_sums.cuh): columns [0, cols) are dw's when dw is given, the rest db's.
constexpr int kSumSlices = 16;

__global__ void __launch_bounds__(kColumnSumCols* kSumSlices)
    column_sum_kernel(const float* __restrict__ partials, int64_t blocks, int64_t cols, int64_t width, float* __restrict__ dw,
                      float* __restrict__ db) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kColumnSumCols + threadIdx.x;
  float total;
  if (!column_total<kSumSlices>(partials, blocks, width, c, total)) return;
  if (dw && c < cols) dw[c] += total;
  else db[c - (dw ? cols : 0)] += total;
}

// ---- launch shapes ----------------------------------------------------------------------

unsigned grid_size(int64_t blocks) {
  KILN_CHECK(blocks <= INT_MAX, kOp, "{} blocks exceed the grid limit", blocks);
  return static_cast<unsigned>(blocks);
}

// Calls f(TX{}, TY{}, integral_constant<kThreads>, integral_constant<W>) for the dtypes,
// the threads per row (by how many vectors a row has) and the vector width.
template <typename F>
void dispatch(DType x_dtype, DType y_dtype, int64_t cols, bool vec, F&& f) {
  auto with_width = [&](auto tx, auto ty, auto width) {
    const int64_t vecs = cols / decltype(width)::value;
    if (vecs <= 8) f(tx, ty, std::integral_constant<int, 8>{}, width);
    else if (vecs <= 16) f(tx, ty, std::integral_constant<int, 16>{}, width);
    else if (vecs <= 128) f(tx, ty, std::integral_constant<int, kWarp>{}, width);
    else f(tx, ty, std::integral_constant<int, kBlockThreads>{}, width);
  };
  auto with_types = [&](auto tx, auto ty) {
    if (vec) with_width(tx, ty, std::integral_constant<int, kVec>{});
    else with_width(tx, ty, std::integral_constant<int, 1>{});
  };
  const bool x_ok = x_dtype == DType::f32 || x_dtype == DType::bf16;
  const bool y_ok = y_dtype == DType::bf16 || (y_dtype == DType::f32 && x_dtype == DType::f32);
  KILN_CHECK(x_ok && y_ok, kOp, "no kernel for x {} with y {}", dtype_name(x_dtype), dtype_name(y_dtype));
  if (y_dtype == DType::f32) with_types(float{}, float{});
  else if (x_dtype == DType::f32) with_types(float{}, bf16{});
  else with_types(bf16{}, bf16{});
}

// Shared memory beyond the 48 KiB default needs an opt-in (rows over 6144 columns with a
// block per row, or 768-1024 with a warp per row, computing both dw and db).
template <typename Kernel>
void allow_shared_memory(Kernel kernel, size_t bytes) {
  constexpr size_t kDefault = 48 * 1024;
  if (bytes <= kDefault) return;
  int device = 0, limit = 0;
  check(cudaGetDevice(&device), kOp, "cudaGetDevice");
  check(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device), kOp, "shared memory limit");
  KILN_CHECK(bytes <= static_cast<size_t>(limit), kOp,
             "rows of this length need {} bytes of shared memory for the gain and bias sums (limit {})", bytes, limit);
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)), kOp,
        "cudaFuncSetAttribute");
}

}  // namespace

void layer_norm_forward(const ExecContext& ctx, const void* x, DType x_dtype, const float* w, const float* b, float eps, int64_t rows,
                        int64_t cols, void* y, DType y_dtype, float* mean, float* rstd, const void* branch,
                        float* sum) {
  if (rows == 0 || cols == 0) return;
  KILN_CHECK(!branch || (x_dtype == DType::f32 && sum), kOp, "the fused residual add takes f32 x and a sum output");
  const bool vec = cols % kVec == 0 && aligned16(x) && aligned16(w) && aligned16(b) && aligned16(y) &&
                   aligned16(branch) && aligned16(sum);
  dispatch(x_dtype, y_dtype, cols, vec, [&](auto tx, auto ty, auto threads, auto width) {
    using TX = decltype(tx);
    using TY = decltype(ty);
    constexpr int kThreads = decltype(threads)::value, W = decltype(width)::value;
    constexpr int kRows = kBlockThreads / kThreads;
    forward_kernel<TX, TY, kThreads, W><<<grid_size((rows + kRows - 1) / kRows), kBlockThreads, 0, stream(ctx)>>>(
        static_cast<const TX*>(x), static_cast<const TY*>(branch), sum, w, b, eps, rows, cols, static_cast<TY*>(y),
        mean, rstd);
    check_launch(kOp, "forward_kernel");
  });
}

void layer_norm_backward(const ExecContext& ctx, const void* x, DType x_dtype, const float* w, const float* mean, const float* rstd,
                         const void* dy, DType y_dtype, int64_t rows, int64_t cols, void* dx, bool accumulate_dx,
                         float* dw, float* db, void* dx_copy) {
  if (rows == 0 || cols == 0) return;
  const int64_t sums = int64_t{dw != nullptr} + int64_t{db != nullptr};
  KILN_CHECK(sums * cols <= kScratchFloats, kOp, "{} columns exceed the gain/bias gradient scratch", cols);
  const bool vec =
      cols % kVec == 0 && aligned16(x) && aligned16(w) && aligned16(dy) && aligned16(dx) && aligned16(dx_copy);
  float* const partials = sums > 0 ? context_scratch_as<float>(ctx, kPartials) : nullptr;
  dispatch(x_dtype, y_dtype, cols, vec, [&](auto tx, auto ty, auto threads, auto width) {
    using TX = decltype(tx);
    using TY = decltype(ty);
    constexpr int kThreads = decltype(threads)::value, W = decltype(width)::value;
    constexpr int64_t kRows = kBlockThreads / kThreads;
    // One block per row group; with column sums at most kMaxPartialRows blocks and what the
    // scratch holds, the rows then spread evenly so that no block is empty.
    const int64_t groups = (rows + kRows - 1) / kRows;
    int64_t blocks = groups, rows_per_block = kRows;
    if (sums > 0) {
      blocks = std::min({groups, kMaxPartialRows, kScratchFloats / (sums * cols)});
      rows_per_block = (rows + blocks - 1) / blocks;
      blocks = (rows + rows_per_block - 1) / rows_per_block;
    }
    const size_t shared = static_cast<size_t>(sums * kRows * cols) * sizeof(float);
    auto kernel = backward_kernel<TX, TY, kThreads, W>;
    allow_shared_memory(kernel, shared);
    kernel<<<grid_size(blocks), kBlockThreads, shared, stream(ctx)>>>(
        static_cast<const TX*>(x), w, mean, rstd, static_cast<const TY*>(dy), rows, cols, rows_per_block,
        static_cast<TX*>(dx), accumulate_dx, static_cast<TY*>(dx_copy), dw != nullptr, db != nullptr, partials);
    check_launch(kOp, "backward_kernel");
    if (sums > 0) {
      const int64_t width_all = sums * cols;
      column_sum_kernel<<<grid_size((width_all + kColumnSumCols - 1) / kColumnSumCols),
                          dim3(kColumnSumCols, kSumSlices), 0, stream(ctx)>>>(partials, blocks, cols, width_all, dw, db);
      check_launch(kOp, "column_sum_kernel");
    }
  });
}

}  // namespace kiln::cuda

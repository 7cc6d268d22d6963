// RMSNorm of the mixed-precision path (declared in ops/rms_norm/rms_norm_cuda.h): x fp32 (the
// residual stream) or bf16 (per-head q/k norm), gain fp32, y and dy bf16, rstd fp32.
// Formulas and fp32 arithmetic are those of rms_norm_cuda.cu.
//
// Rows map to groups of kThreads threads inside 256-thread blocks: 8 or 16 threads for
// head-sized rows (64 or 128 columns), a warp for rows up to 1024 columns, the whole
// block above that. A group's sums reduce by shuffles (and shared memory across warps),
// always in the same order. Rows whose length is a multiple of 8 with 16-byte aligned
// pointers move 8 elements per thread per access (16 bytes of bf16, two float4 of fp32);
// any other row takes the scalar path.
//
// dw = sum over rows of dy * x * rstd is fused into the dx kernel, so x and dy are read
// from memory once for both (the fp32 path's column-parallel dw kernel would reread them,
// and its cols / 32 blocks are too few to stream at full bandwidth). Each block owns a
// contiguous range of rows, every thread keeps its columns' running sums in shared
// memory (one set per group), and at the end the block folds its groups in order and
// writes one row of partial sums to the context's device scratch (core/context_scratch.h).
// A second kernel adds the partial rows column by column in a fixed order and does
// `dw +=`. The block count depends only on the shape and the path taken (dtype, vector or
// scalar), so dw is bitwise reproducible. No allocation after the first call, no host
// synchronization: safe under CUDA-graph capture. Each stream has its own scratch and its
// calls run one after another, so two calls never share it at once.
#include "core/context_scratch.h"
#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "ops/rms_norm/rms_norm_cuda.h"

#include "ops/bf16_vector.cuh"
#include "ops/block_reduce.cuh"
#include "ops/column_sums.cuh"

#include <cuda_bf16.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <type_traits>

namespace kiln::cuda {

namespace {

using bf16 = __nv_bfloat16;

constexpr const char* kOp = "rms_norm_mixed";
constexpr int kWarp = 32;
constexpr int kBlockThreads = 256;
constexpr int kVec = vec::kWidth;

// dw scratch: at most kDwBlocks partial rows of `cols` floats, 16 MiB in all. 2048 blocks
// of one or more row groups fill an H200 (132 SMs) several times over, so the last wave
// is short; longer rows get fewer blocks so that blocks * cols fits.
constexpr int64_t kDwBlocks = 2048;
constexpr int64_t kDwScratchFloats = int64_t{1} << 22;
constexpr ScratchKind kDwPartials{"rms_norm_backward", kDwScratchFloats * sizeof(float)};

bool aligned16(const void* p) { return p == nullptr || vec::aligned16(p); }

using vec::load;
using vec::store;

// The gain, or ones without one.
template <int W>
__device__ __forceinline__ void load_gain(const float* w, int64_t c, float (&v)[W]) {
  if (w) {
    load<W>(w + c, v);
  } else {
#pragma unroll
    for (int k = 0; k < W; ++k) v[k] = 1.0f;
  }
}

// ---- kernels ------------------------------------------------------------------------------

// The row's input: x, or with a branch b (the fused residual add) x + b, which is also
// stored to `sum` by the first pass.
template <int W, typename TX>
__device__ __forceinline__ void load_input(const TX* xr, const bf16* br, int64_t at, float (&v)[W]) {
  load<W>(xr + at, v);
  if (br) {
    float b[W];
    load<W>(br + at, b);
#pragma unroll
    for (int k = 0; k < W; ++k) v[k] += b[k];
  }
}

// Blocks of kThreads * kRows = 256 threads, kRows rows per block, one group per row.
// With b (fp32 x only): sum = x + b is normalized and written to `sum` (the fused
// residual add of the pre-norm block).
template <typename TX, int kThreads, int W>
__global__ void __launch_bounds__(kBlockThreads)
    forward_kernel(const TX* __restrict__ x, const bf16* __restrict__ b, float* __restrict__ sum,
                   const float* __restrict__ w, float eps, int64_t rows, int64_t cols, bf16* __restrict__ y,
                   float* __restrict__ rstd) {
  constexpr int kRows = kBlockThreads / kThreads;
  const int t = static_cast<int>(threadIdx.x % kThreads);
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRows + threadIdx.x / kThreads;
  const bool valid = row < rows;  // groups past the last row still join the shuffles
  const int64_t vecs = valid ? cols / W : 0;
  const TX* xr = x + (valid ? row : 0) * cols;
  const bf16* br = b ? b + (valid ? row : 0) * cols : nullptr;
  bf16* yr = y + (valid ? row : 0) * cols;

  float sum_sq = 0.0f;
  for (int64_t i = t; i < vecs; i += kThreads) {
    float v[W];
    load_input<W>(xr, br, i * W, v);
    if (br) store<W>(sum + row * cols + i * W, v);
#pragma unroll
    for (int k = 0; k < W; ++k) sum_sq += v[k] * v[k];
  }
  sum_sq = block_sum<kThreads>(sum_sq);  // the row group's total (ops/block_reduce.cuh)
  const float inv = 1.0f / sqrtf(sum_sq / static_cast<float>(cols) + eps);
  if (valid && t == 0) rstd[row] = inv;

  for (int64_t i = t; i < vecs; i += kThreads) {
    float v[W], g[W], out[W];
    load_input<W>(xr, br, i * W, v);
    load_gain<W>(w, i * W, g);
#pragma unroll
    for (int k = 0; k < W; ++k) out[k] = v[k] * inv * g[k];
    store<W>(yr + i * W, out);
  }
}

// dx = r * (g - x * r^2 * mean(g * x)) with g = dy * w, `=` or `+=` by accumulate; with
// with_dw, also this block's partial sums of dy * x * r per column (see the top).
// Block b owns rows [b * rows_per_block, ...); its kRows groups take them kRows at a time,
// every group running the same number of iterations (the shuffles and barriers need all).
template <typename TX, int kThreads, int W>
__global__ void __launch_bounds__(kBlockThreads)
    backward_kernel(const TX* __restrict__ x, const float* __restrict__ w, const float* __restrict__ rstd,
                    const bf16* __restrict__ dy, int64_t rows, int64_t cols, int64_t rows_per_block,
                    TX* __restrict__ dx, bool accumulate, bool with_dw, bf16* __restrict__ dx_copy,
                    float* __restrict__ dw_partials) {
  constexpr int kRows = kBlockThreads / kThreads;
  extern __shared__ float dw_sums[];  // kRows sets of cols sums when with_dw
  const int t = static_cast<int>(threadIdx.x % kThreads);
  const int group = static_cast<int>(threadIdx.x / kThreads);
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * rows_per_block;
  const int64_t end = begin + rows_per_block < rows ? begin + rows_per_block : rows;
  const int64_t iterations = (end - begin + kRows - 1) / kRows;
  // Column i * W + k sits at my_sums[k * (cols / W) + i]: for each k a warp touches
  // consecutive words (no bank conflicts), and each slot belongs to one thread.
  const int64_t stride = cols / W;
  float* my_sums = dw_sums + group * cols;
  if (with_dw)
    for (int64_t i = t; i < stride; i += kThreads)
#pragma unroll
      for (int k = 0; k < W; ++k) my_sums[k * stride + i] = 0.0f;

  for (int64_t it = 0; it < iterations; ++it) {
    const int64_t row = begin + it * kRows + group;
    const bool valid = row < end;
    const int64_t vecs = valid ? cols / W : 0;
    const TX* xr = x + (valid ? row : 0) * cols;
    const bf16* gr = dy + (valid ? row : 0) * cols;
    TX* dxr = dx + (valid ? row : 0) * cols;

    float dot = 0.0f;
    for (int64_t i = t; i < vecs; i += kThreads) {
      float v[W], d[W], s[W];
      load<W>(xr + i * W, v);
      load<W>(gr + i * W, d);
      load_gain<W>(w, i * W, s);
#pragma unroll
      for (int k = 0; k < W; ++k) dot += d[k] * s[k] * v[k];
    }
    dot = block_sum<kThreads>(dot);
    if (!valid) continue;
    const float inv = rstd[row];
    const float coef = dot * inv * inv / static_cast<float>(cols);

    for (int64_t i = t; i < vecs; i += kThreads) {
      float v[W], d[W], s[W], out[W];
      load<W>(xr + i * W, v);
      load<W>(gr + i * W, d);
      load_gain<W>(w, i * W, s);
#pragma unroll
      for (int k = 0; k < W; ++k) out[k] = inv * (d[k] * s[k] - v[k] * coef);
      if (accumulate) {
        float old[W];
        load<W>(dxr + i * W, old);
#pragma unroll
        for (int k = 0; k < W; ++k) out[k] = old[k] + out[k];
      }
      store<W>(dxr + i * W, out);
      if (dx_copy) store<W>(dx_copy + row * cols + i * W, out);
      if (with_dw)
#pragma unroll
        for (int k = 0; k < W; ++k) my_sums[k * stride + i] += d[k] * v[k] * inv;
    }
  }
  if (!with_dw) return;

  __syncthreads();  // every group's sums are complete
  float* partial = dw_partials + static_cast<int64_t>(blockIdx.x) * cols;
  for (int64_t c = threadIdx.x; c < cols; c += kBlockThreads) {
    float total = 0.0f;
    const int64_t slot = c % W * stride + c / W;
    for (int g = 0; g < kRows; ++g) total += dw_sums[g * cols + slot];
    partial[c] = total;
  }
}

// dw[c] += sum over blocks b of dw_partials[b][c], in a fixed order (ops/column_sums.cuh).
constexpr int kSumSlices = 16;

__global__ void __launch_bounds__(kColumnSumCols* kSumSlices)
    dw_sum_kernel(const float* __restrict__ dw_partials, int64_t blocks, int64_t cols, float* __restrict__ dw) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kColumnSumCols + threadIdx.x;
  float total;
  if (column_total<kSumSlices>(dw_partials, blocks, cols, c, total)) dw[c] += total;
}

// ---- launch shapes --------------------------------------------------------------------------

unsigned grid_size(int64_t blocks) {
  KILN_CHECK(blocks <= INT_MAX, kOp, "{} blocks exceed the grid limit", blocks);
  return static_cast<unsigned>(blocks);
}

// Calls f(TX{}, integral_constant<kThreads>, integral_constant<W>) for x's dtype, the
// threads per row (by how many vectors a row has) and the vector width.
template <typename F>
void dispatch(DType x_dtype, int64_t cols, bool vec, F&& f) {
  auto with_width = [&](auto tx, auto width) {
    const int64_t vecs = cols / decltype(width)::value;
    if (vecs <= 8) f(tx, std::integral_constant<int, 8>{}, width);
    else if (vecs <= 16) f(tx, std::integral_constant<int, 16>{}, width);
    else if (vecs <= 128) f(tx, std::integral_constant<int, kWarp>{}, width);
    else f(tx, std::integral_constant<int, kBlockThreads>{}, width);
  };
  auto with_type = [&](auto tx) {
    if (vec) with_width(tx, std::integral_constant<int, kVec>{});
    else with_width(tx, std::integral_constant<int, 1>{});
  };
  if (x_dtype == DType::bf16) with_type(bf16{});
  else with_type(float{});
}

// Shared memory of the backward kernel beyond the 48 KiB default needs an opt-in; rows
// that long (over 12288 columns with a whole block per row) are rare, so it is set lazily.
template <typename Kernel>
void allow_shared_memory(Kernel kernel, size_t bytes) {
  constexpr size_t kDefault = 48 * 1024;
  if (bytes <= kDefault) return;
  int device = 0, limit = 0;
  check(cudaGetDevice(&device), kOp, "cudaGetDevice");
  check(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device), kOp, "shared memory limit");
  KILN_CHECK(bytes <= static_cast<size_t>(limit), kOp, "rows of this length need {} bytes of shared memory (limit {})",
             bytes, limit);
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)), kOp,
        "cudaFuncSetAttribute");
}

}  // namespace

void rms_norm_forward_mixed(const ExecContext& ctx, const void* x, DType x_dtype, const float* w, float eps, int64_t rows, int64_t cols,
                            bf16_bits* y, float* rstd, const bf16_bits* b, float* sum) {
  if (rows == 0) return;
  KILN_CHECK(!b || (x_dtype == DType::f32 && sum), kOp, "the fused residual add takes fp32 x and a sum output");
  const bool vec = cols % kVec == 0 && aligned16(x) && aligned16(w) && aligned16(y) && aligned16(b) && aligned16(sum);
  dispatch(x_dtype, cols, vec, [&](auto tx, auto threads, auto width) {
    using TX = decltype(tx);
    constexpr int kThreads = decltype(threads)::value, W = decltype(width)::value;
    constexpr int kRows = kBlockThreads / kThreads;
    forward_kernel<TX, kThreads, W><<<grid_size((rows + kRows - 1) / kRows), kBlockThreads, 0, stream(ctx)>>>(
        static_cast<const TX*>(x), reinterpret_cast<const bf16*>(b), sum, w, eps, rows, cols,
        reinterpret_cast<bf16*>(y), rstd);
    check_launch(kOp, "forward_kernel");
  });
}

void rms_norm_backward_mixed(const ExecContext& ctx, const void* x, DType x_dtype, const float* w, const float* rstd, const bf16_bits* dy,
                             int64_t rows, int64_t cols, void* dx, bool accumulate_dx, float* dw,
                             bf16_bits* dx_copy) {
  if (rows == 0 || cols == 0) return;
  KILN_CHECK(cols <= kDwScratchFloats, kOp, "{} columns exceed the dw scratch", cols);
  const bool vec =
      cols % kVec == 0 && aligned16(x) && aligned16(w) && aligned16(dy) && aligned16(dx) && aligned16(dx_copy);
  const bool with_dw = dw != nullptr;
  float* const dw_partials = with_dw ? context_scratch_as<float>(ctx, kDwPartials) : nullptr;
  dispatch(x_dtype, cols, vec, [&](auto tx, auto threads, auto width) {
    using TX = decltype(tx);
    constexpr int kThreads = decltype(threads)::value, W = decltype(width)::value;
    constexpr int64_t kRows = kBlockThreads / kThreads;
    // Blocks: one per row group, at most kDwBlocks and what the scratch holds. Then rows
    // are spread evenly, every block getting at least one (no block is empty).
    const int64_t groups = (rows + kRows - 1) / kRows;
    int64_t blocks = std::min({groups, kDwBlocks, kDwScratchFloats / cols});
    const int64_t rows_per_block = (rows + blocks - 1) / blocks;
    blocks = (rows + rows_per_block - 1) / rows_per_block;
    const size_t shared = with_dw ? static_cast<size_t>(kRows * cols) * sizeof(float) : 0;
    auto kernel = backward_kernel<TX, kThreads, W>;
    allow_shared_memory(kernel, shared);
    kernel<<<grid_size(blocks), kBlockThreads, shared, stream(ctx)>>>(
        static_cast<const TX*>(x), w, rstd, reinterpret_cast<const bf16*>(dy), rows, cols, rows_per_block,
        static_cast<TX*>(dx), accumulate_dx, with_dw, reinterpret_cast<bf16*>(dx_copy), dw_partials);
    check_launch(kOp, "backward_kernel");
    if (with_dw) {
      dw_sum_kernel<<<grid_size((cols + kColumnSumCols - 1) / kColumnSumCols), dim3(kColumnSumCols, kSumSlices), 0,
                      stream(ctx)>>>(
          dw_partials, blocks, cols, dw);
      check_launch(kOp, "dw_sum_kernel");
    }
  });
}

}  // namespace kiln::cuda

// CUDA kernels for RMSNorm in fp32 (declared in rms_norm_cuda.h).
//
// Forward and the dx half of backward map one row to a group of threads: a warp when the
// row is short (8 rows per 256-thread block), a whole 256-thread block when it is long.
// Sums accumulate in fp32 in a fixed order (strided partials, then a shuffle tree), so a
// launch is reproducible run to run. Rows whose length is a multiple of 4 with 16-byte
// aligned pointers use float4 loads and stores; any other length takes the scalar path.
//
// dw is a column reduction over rows. A column-parallel kernel computes it: each block
// owns 32 columns, its 16 row slices stride over the rows, and the slices are summed in
// order through shared memory before one `+=` per column. No atomics and no scratch, so
// it is deterministic and allocation-free (CUDA-graph safe).
#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "ops/rms_norm/rms_norm_cuda.h"
#include "ops/block_reduce.cuh"

#include <climits>
#include <cstdint>

namespace kiln::cuda {

namespace {

constexpr const char* kOp = "rms_norm";
constexpr int kWarp = 32;
constexpr int kBlockThreads = 256;
// Rows up to this length get a warp each; longer rows a block each.
constexpr int64_t kWarpRowMaxCols = 1024;


// kThreads threads per row, kRows rows per block (kThreads * kRows threads).
// The block kernel (kRows == 1) is launched with exactly one block per row, so no thread
// leaves before the barriers in block_sum; the warp kernel has no block barriers.
template <int kThreads, int kRows, bool kVec>
__global__ void __launch_bounds__(kThreads* kRows)
    forward_kernel(const float* __restrict__ x, const float* __restrict__ w, float eps, int64_t rows, int64_t cols,
                   float* __restrict__ y, float* __restrict__ rstd) {
  const int t = static_cast<int>(threadIdx.x % kThreads);
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRows + threadIdx.x / kThreads;
  if (row >= rows) return;
  const float* xr = x + row * cols;
  float* yr = y + row * cols;

  float sum_sq = 0.0f;
  if constexpr (kVec) {
    const float4* x4 = reinterpret_cast<const float4*>(xr);
    for (int64_t i = t; i < cols / 4; i += kThreads) {
      const float4 v = x4[i];
      sum_sq += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    }
  } else {
    for (int64_t c = t; c < cols; c += kThreads) sum_sq += xr[c] * xr[c];
  }
  sum_sq = block_sum<kThreads>(sum_sq);
  const float inv = 1.0f / sqrtf(sum_sq / static_cast<float>(cols) + eps);
  if (t == 0) rstd[row] = inv;

  if constexpr (kVec) {
    const float4* x4 = reinterpret_cast<const float4*>(xr);
    const float4* w4 = reinterpret_cast<const float4*>(w);
    float4* y4 = reinterpret_cast<float4*>(yr);
    for (int64_t i = t; i < cols / 4; i += kThreads) {
      const float4 v = x4[i];
      const float4 g = w ? w4[i] : make_float4(1.0f, 1.0f, 1.0f, 1.0f);
      y4[i] = make_float4(v.x * inv * g.x, v.y * inv * g.y, v.z * inv * g.z, v.w * inv * g.w);
    }
  } else {
    for (int64_t c = t; c < cols; c += kThreads) yr[c] = xr[c] * inv * (w ? w[c] : 1.0f);
  }
}

// dx = r * (g - x * r^2 * mean(g * x)) with g = dy * w; `=` or `+=` by accumulate.
template <int kThreads, int kRows, bool kVec>
__global__ void __launch_bounds__(kThreads* kRows)
    backward_dx_kernel(const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ rstd,
                       const float* __restrict__ dy, int64_t rows, int64_t cols, float* __restrict__ dx,
                       bool accumulate) {
  const int t = static_cast<int>(threadIdx.x % kThreads);
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRows + threadIdx.x / kThreads;
  if (row >= rows) return;
  const float* xr = x + row * cols;
  const float* gr = dy + row * cols;
  float* dxr = dx + row * cols;
  const float4 one = make_float4(1.0f, 1.0f, 1.0f, 1.0f);

  float dot = 0.0f;
  if constexpr (kVec) {
    const float4* x4 = reinterpret_cast<const float4*>(xr);
    const float4* g4 = reinterpret_cast<const float4*>(gr);
    const float4* w4 = reinterpret_cast<const float4*>(w);
    for (int64_t i = t; i < cols / 4; i += kThreads) {
      const float4 v = x4[i], d = g4[i], s = w ? w4[i] : one;
      dot += d.x * s.x * v.x + d.y * s.y * v.y + d.z * s.z * v.z + d.w * s.w * v.w;
    }
  } else {
    for (int64_t c = t; c < cols; c += kThreads) dot += gr[c] * (w ? w[c] : 1.0f) * xr[c];
  }
  dot = block_sum<kThreads>(dot);
  const float inv = rstd[row];
  const float coef = dot * inv * inv / static_cast<float>(cols);

  if constexpr (kVec) {
    const float4* x4 = reinterpret_cast<const float4*>(xr);
    const float4* g4 = reinterpret_cast<const float4*>(gr);
    const float4* w4 = reinterpret_cast<const float4*>(w);
    float4* dx4 = reinterpret_cast<float4*>(dxr);
    for (int64_t i = t; i < cols / 4; i += kThreads) {
      const float4 v = x4[i], d = g4[i], s = w ? w4[i] : one;
      float4 out = make_float4(inv * (d.x * s.x - v.x * coef), inv * (d.y * s.y - v.y * coef),
                               inv * (d.z * s.z - v.z * coef), inv * (d.w * s.w - v.w * coef));
      if (accumulate) {
        const float4 old = dx4[i];
        out = make_float4(old.x + out.x, old.y + out.y, old.z + out.z, old.w + out.w);
      }
      dx4[i] = out;
    }
  } else {
    for (int64_t c = t; c < cols; c += kThreads) {
      const float value = inv * (gr[c] * (w ? w[c] : 1.0f) - xr[c] * coef);
      dxr[c] = accumulate ? dxr[c] + value : value;
    }
  }
}

// dw[c] += sum over rows of dy * x * rstd. Block (kDwCols, kDwSlices): threadIdx.x picks the
// column (a warp reads 32 consecutive floats of one row), threadIdx.y the row slice.
constexpr int kDwCols = 32;
constexpr int kDwSlices = 16;

__global__ void __launch_bounds__(kDwCols* kDwSlices)
    backward_dw_kernel(const float* __restrict__ x, const float* __restrict__ rstd, const float* __restrict__ dy,
                       int64_t rows, int64_t cols, float* __restrict__ dw) {
  __shared__ float partial[kDwSlices][kDwCols + 1];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kDwCols + threadIdx.x;
  float sum = 0.0f;
  if (c < cols) {
#pragma unroll 4
    for (int64_t r = threadIdx.y; r < rows; r += kDwSlices) sum += dy[r * cols + c] * x[r * cols + c] * rstd[r];
  }
  partial[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float total = 0.0f;
#pragma unroll
    for (int s = 0; s < kDwSlices; ++s) total += partial[s][threadIdx.x];
    dw[c] += total;
  }
}

bool aligned16(const void* p) { return p == nullptr || (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

unsigned grid_size(int64_t items, int64_t per_block) {
  const int64_t blocks = (items + per_block - 1) / per_block;
  KILN_CHECK(blocks <= INT_MAX, kOp, "{} blocks exceed the grid limit", blocks);
  return static_cast<unsigned>(blocks);
}

// Calls launch(kernel-shape tag) with the row mapping and vector width chosen for `cols`.
template <template <int, int, bool> class Launch, typename... Args>
void launch_rows(int64_t rows, int64_t cols, bool vec, cudaStream_t stream, Args... args) {
  if (cols <= kWarpRowMaxCols) {
    constexpr int kRows = kBlockThreads / kWarp;
    const unsigned grid = grid_size(rows, kRows);
    if (vec) Launch<kWarp, kRows, true>::run(grid, stream, args...);
    else Launch<kWarp, kRows, false>::run(grid, stream, args...);
  } else {
    const unsigned grid = grid_size(rows, 1);
    if (vec) Launch<kBlockThreads, 1, true>::run(grid, stream, args...);
    else Launch<kBlockThreads, 1, false>::run(grid, stream, args...);
  }
}

template <int kThreads, int kRows, bool kVec>
struct LaunchForward {
  template <typename... Args>
  static void run(unsigned grid, cudaStream_t stream, Args... args) {
    forward_kernel<kThreads, kRows, kVec><<<grid, kThreads * kRows, 0, stream>>>(args...);
    check_launch(kOp, "forward kernel launch");
  }
};

template <int kThreads, int kRows, bool kVec>
struct LaunchBackwardDx {
  template <typename... Args>
  static void run(unsigned grid, cudaStream_t stream, Args... args) {
    backward_dx_kernel<kThreads, kRows, kVec><<<grid, kThreads * kRows, 0, stream>>>(args...);
    check_launch(kOp, "backward dx kernel launch");
  }
};

}  // namespace

void rms_norm_forward_f32(const ExecContext& ctx, const float* x, const float* w, float eps, int64_t rows, int64_t cols,
                          float* y, float* rstd) {
  if (rows == 0) return;
  const bool vec = cols % 4 == 0 && aligned16(x) && aligned16(w) && aligned16(y);
  launch_rows<LaunchForward>(rows, cols, vec, stream(ctx), x, w, eps, rows, cols, y, rstd);
}

void rms_norm_backward_f32(const ExecContext& ctx, const float* x, const float* w, const float* rstd, const float* dy,
                           int64_t rows, int64_t cols, float* dx, float* dw, bool accumulate_dx) {
  if (rows == 0 || cols == 0) return;
  const cudaStream_t s = stream(ctx);
  const bool vec = cols % 4 == 0 && aligned16(x) && aligned16(w) && aligned16(dy) && aligned16(dx);
  launch_rows<LaunchBackwardDx>(rows, cols, vec, s, x, w, rstd, dy, rows, cols, dx, accumulate_dx);
  if (dw) {
    backward_dw_kernel<<<grid_size(cols, kDwCols), dim3(kDwCols, kDwSlices), 0, s>>>(x, rstd, dy, rows, cols, dw);
    check_launch(kOp, "backward dw kernel launch");
  }
}

}  // namespace kiln::cuda

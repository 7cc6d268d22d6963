// FP8 quantize kernels (contract in ops/fp8/fp8_quantize_cuda.h). Every step copies the CPU
// emulation's arithmetic (ops/fp8/fp8_scaling.cpp) so the codes and inverse scales are the
// same bits: amax is a max (exact in any order, so atomics and shuffles keep it
// deterministic); the scale and cast are fp8_cast.cuh's (shared with the experts' kernels).
#include "ops/fp8/fp8_quantize_cuda.h"

#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "core/error.h"
#include "ops/fp8/fp8_cast.cuh"
#include "ops/fp8/fp8_quantize_common.cuh"

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>

namespace kiln::cuda {

namespace {

using namespace fp8_quantize_detail;
using ops::fp8::Format;

constexpr int kTile = 32;        // tensorwise cast: 32 x 32 tiles (transposed through shared memory)
constexpr int kTileRows = 8;     // ... by 32 x 8 threads, four rows each
constexpr int kAmaxThreads = 256;
constexpr unsigned kAmaxBlocksMax = 1024;

using fp8_cast::cast;
using fp8_cast::cast8;
using fp8_cast::scale_from_amax;

// *amax (zeroed before) = max |x|: non-negative floats order as their bits do, so an
// unsigned atomicMax of the bits is the float max.
template <typename T>
__global__ void amax_kernel(const T* x, int64_t n, float* amax) {
  float m = 0.0f;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    m = fmaxf(m, fabsf(ld(x + i)));
  m = block_max(m);
  if (threadIdx.x == 0) atomicMax(reinterpret_cast<unsigned*>(amax), __float_as_uint(m));
}

// One 32 x 32 tile a block: codes row-major, and through shared memory the transposed
// codes, so both writes are coalesced.
template <typename T>
__global__ void tensorwise_cast_kernel(const T* x, int64_t rows, int64_t cols, float fp8_max,
                                       __nv_fp8_interpretation_t format, const float* amax, uint8_t* codes,
                                       uint8_t* codes_t, float* scale_inv) {
  __shared__ uint8_t tile[kTile][kTile + 4];
  const float scale = scale_from_amax(*amax, fp8_max);
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0 && threadIdx.y == 0) *scale_inv = __fdiv_rn(1.0f, scale);
  const int64_t row0 = blockIdx.y * int64_t{kTile}, col0 = blockIdx.x * int64_t{kTile};
  const int64_t col = col0 + threadIdx.x;
  for (int i = threadIdx.y; i < kTile; i += kTileRows) {
    const int64_t row = row0 + i;
    if (row < rows && col < cols) {
      const uint8_t c = cast(ld(x + row * cols + col), scale, format);
      if (codes != nullptr) codes[row * cols + col] = c;
      tile[i][threadIdx.x] = c;
    }
  }
  if (codes_t == nullptr) return;
  __syncthreads();
  // codes_t [cols, rows]: this block's tile transposed, row col0 + i, columns row0 + tx.
  const int64_t t_col = row0 + threadIdx.x;
  for (int i = threadIdx.y; i < kTile; i += kTileRows) {
    const int64_t t_row = col0 + i;
    if (t_row < cols && t_col < rows) codes_t[t_row * rows + t_col] = tile[threadIdx.x][i];
  }
}

// ---- tensorwise, eight elements a thread ------------------------------------------------
// The training path's shapes (cols a multiple of 8, rows of 16, 16-byte aligned operands:
// every LinearLayer call that runs in FP8): the same arithmetic per element as the kernels
// above, with 16-byte loads and 8- or 16-byte stores instead of one element a thread.
constexpr int kWideTile = 64;  // the transposing cast's tile edge: 64 x 64 elements, 256 threads

// gridDim.z matrices of `groups` groups each (one, unless batched): matrix z's amax[z].
template <typename T>
__global__ void amax_wide_kernel(const T* x, int64_t groups, float* amax) {
  x += blockIdx.z * 8 * groups, amax += blockIdx.z;
  float m = 0.0f, v[8];
  for (int64_t g = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; g < groups; g += int64_t{gridDim.x} * blockDim.x) {
    load8(x + 8 * g, v);
    for (int j = 0; j < 8; ++j) m = fmaxf(m, fabsf(v[j]));
  }
  m = block_max(m);
  if (threadIdx.x == 0) atomicMax(reinterpret_cast<unsigned*>(amax), __float_as_uint(m));
}

// Row-major codes only: a thread per eight consecutive elements (grid-stride).
template <typename T>
__global__ void cast_wide_kernel(const T* x, int64_t groups, float fp8_max, __nv_fp8_interpretation_t format,
                                 const float* amax, uint8_t* codes, float* scale_inv) {
  x += blockIdx.z * 8 * groups, codes += blockIdx.z * 8 * groups, amax += blockIdx.z, scale_inv += blockIdx.z;
  const float scale = scale_from_amax(*amax, fp8_max);
  if (blockIdx.x == 0 && threadIdx.x == 0) *scale_inv = __fdiv_rn(1.0f, scale);
  float v[8];
  for (int64_t g = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; g < groups; g += int64_t{gridDim.x} * blockDim.x) {
    load8(x + 8 * g, v);
    reinterpret_cast<uint2*>(codes)[g] = cast8(v, scale, format);
  }
}

// One 64 x 64 tile a block of 256 threads: each loads 8 elements of a row (two rows apart
// by 32), stores their codes row-major (when asked) and into shared memory; then each
// writes 16 bytes of a transposed row. rows % 16 == 0 and cols % 8 == 0, so an edge tile
// holds whole groups only.
template <typename T>
__global__ void cast_transpose_wide_kernel(const T* x, int64_t rows, int64_t cols, float fp8_max,
                                           __nv_fp8_interpretation_t format, const float* amax, uint8_t* codes,
                                           uint8_t* codes_t, float* scale_inv) {
  __shared__ uint8_t tile[kWideTile][kWideTile + 4];
  const int64_t matrix = blockIdx.z * rows * cols;  // gridDim.z matrices (one, unless batched)
  x += matrix, codes_t += matrix, amax += blockIdx.z, scale_inv += blockIdx.z;
  if (codes != nullptr) codes += matrix;
  const float scale = scale_from_amax(*amax, fp8_max);
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *scale_inv = __fdiv_rn(1.0f, scale);
  const int64_t row0 = blockIdx.y * int64_t{kWideTile}, col0 = blockIdx.x * int64_t{kWideTile};
  const int group = threadIdx.x % 8, r = threadIdx.x / 8;  // 8 groups of 8 columns, 32 rows a pass
  const int64_t col = col0 + 8 * group;
  for (int pass = 0; pass < 2; ++pass) {
    const int i = r + 32 * pass;
    const int64_t row = row0 + i;
    if (row >= rows || col >= cols) continue;
    float v[8];
    load8(x + row * cols + col, v);
    const uint2 packed = cast8(v, scale, format);
    if (codes != nullptr) *reinterpret_cast<uint2*>(codes + row * cols + col) = packed;
    *reinterpret_cast<uint32_t*>(&tile[i][8 * group]) = packed.x;
    *reinterpret_cast<uint32_t*>(&tile[i][8 * group + 4]) = packed.y;
  }
  __syncthreads();
  // codes_t [cols, rows]: transposed row col0 + c, bytes row0 + 16 h .. + 16.
  const int c = threadIdx.x / 4, h = threadIdx.x % 4;
  const int64_t t_row = col0 + c, t_col = row0 + 16 * h;
  if (t_row >= cols || t_col >= rows) return;
  uint32_t word[4] = {0, 0, 0, 0};
  for (int j = 0; j < 16; ++j) word[j / 4] |= uint32_t{tile[16 * h + j][c]} << (8 * (j % 4));
  *reinterpret_cast<uint4*>(codes_t + t_row * rows + t_col) = make_uint4(word[0], word[1], word[2], word[3]);
}

}  // namespace

void fp8_quantize_tensorwise(const ExecContext& ctx, DType dtype, const void* x, int64_t rows, int64_t cols,
                             Format format, uint8_t* codes, uint8_t* codes_t, float* amax, float* scale_inv,
                             bool amax_ready) {
  constexpr const char* kOp = "fp8_quantize_tensorwise";
  KILN_CHECK(rows > 0 && cols > 0, kOp, "matrix [{}, {}] must not be empty", rows, cols);
  KILN_CHECK(ceil_div(rows, kTile) <= 65535, kOp, "{} rows pass the grid's 65535 x {} limit", rows, kTile);
  KILN_CHECK(codes != nullptr || codes_t != nullptr, kOp, "neither codes nor codes_t is given");
  const cudaStream_t s = stream(ctx);
  const float fp8_max = ops::fp8::info(format).max;
  if (!amax_ready) check(cudaMemsetAsync(amax, 0, sizeof(float), s), kOp, "cudaMemsetAsync amax");
  const int64_t n = rows * cols;
  const unsigned amax_blocks = std::min<unsigned>(blocks_for(n, kAmaxThreads), kAmaxBlocksMax);
  const dim3 grid(static_cast<unsigned>(ceil_div(cols, kTile)), static_cast<unsigned>(ceil_div(rows, kTile)));
  // The wide kernels where the shape and alignment allow them (every FP8 LinearLayer call).
  const bool wide = cols % 8 == 0 && rows % 16 == 0 && aligned_to(x, 16) && aligned_to(codes, 8) &&
                    aligned_to(codes_t, 16) && ceil_div(rows, kWideTile) <= 65535;
  by_dtype(kOp, dtype, [&]<typename T>() {
    const T* xt = static_cast<const T*>(x);
    if (wide) {
      const int64_t groups = n / 8;
      if (!amax_ready) {
        amax_wide_kernel<T><<<std::min<unsigned>(blocks_for(groups, kAmaxThreads), kAmaxBlocksMax), kAmaxThreads, 0,
                              s>>>(xt, groups, amax);
        check_launch(kOp, "amax_wide_kernel");
      }
      if (codes_t == nullptr) {
        cast_wide_kernel<T><<<blocks_for(groups, 256), 256, 0, s>>>(xt, groups, fp8_max, cuda_format(format), amax,
                                                                    codes, scale_inv);
        check_launch(kOp, "cast_wide_kernel");
      } else {
        const dim3 tiles(static_cast<unsigned>(ceil_div(cols, kWideTile)),
                         static_cast<unsigned>(ceil_div(rows, kWideTile)));
        cast_transpose_wide_kernel<T><<<tiles, 256, 0, s>>>(xt, rows, cols, fp8_max, cuda_format(format), amax,
                                                            codes, codes_t, scale_inv);
        check_launch(kOp, "cast_transpose_wide_kernel");
      }
      return;
    }
    if (!amax_ready) {
      amax_kernel<T><<<amax_blocks, kAmaxThreads, 0, s>>>(static_cast<const T*>(x), n, amax);
      check_launch(kOp, "amax_kernel");
    }
    tensorwise_cast_kernel<T><<<grid, dim3(kTile, kTileRows), 0, s>>>(static_cast<const T*>(x), rows, cols, fp8_max,
                                                                      cuda_format(format), amax, codes, codes_t,
                                                                      scale_inv);
    check_launch(kOp, "tensorwise_cast_kernel");
  });
}

void fp8_quantize_tensorwise_batched(const ExecContext& ctx, DType dtype, const void* x, int64_t batch, int64_t rows,
                                     int64_t cols, Format format, uint8_t* codes, uint8_t* codes_t, float* amax,
                                     float* scale_inv) {
  constexpr const char* kOp = "fp8_quantize_tensorwise_batched";
  KILN_CHECK(batch > 0 && batch <= 65535 && rows > 0 && cols > 0, kOp, "{} matrices [{}, {}]", batch, rows, cols);
  KILN_CHECK(codes != nullptr || codes_t != nullptr, kOp, "neither codes nor codes_t is given");
  KILN_CHECK(cols % 8 == 0 && rows % 16 == 0 && aligned_to(x, 16) && aligned_to(codes, 8) && aligned_to(codes_t, 16) &&
                 ceil_div(rows, kWideTile) <= 65535,
             kOp, "[{}, {}] at {} is not a wide kernel's shape (rows % 16, cols % 8, 16-byte aligned)", rows, cols, x);
  const cudaStream_t s = stream(ctx);
  const float fp8_max = ops::fp8::info(format).max;
  check(cudaMemsetAsync(amax, 0, static_cast<size_t>(batch) * sizeof(float), s), kOp, "cudaMemsetAsync amax");
  const int64_t groups = rows * cols / 8;
  const unsigned z = static_cast<unsigned>(batch);
  by_dtype(kOp, dtype, [&]<typename T>() {
    const T* xt = static_cast<const T*>(x);
    amax_wide_kernel<T><<<dim3(std::min<unsigned>(blocks_for(groups, kAmaxThreads), kAmaxBlocksMax), 1, z),
                          kAmaxThreads, 0, s>>>(xt, groups, amax);
    check_launch(kOp, "amax_wide_kernel");
    if (codes_t == nullptr) {
      cast_wide_kernel<T><<<dim3(blocks_for(groups, 256), 1, z), 256, 0, s>>>(xt, groups, fp8_max, cuda_format(format),
                                                                             amax, codes, scale_inv);
      check_launch(kOp, "cast_wide_kernel");
    } else {
      const dim3 tiles(static_cast<unsigned>(ceil_div(cols, kWideTile)), static_cast<unsigned>(ceil_div(rows, kWideTile)),
                       z);
      cast_transpose_wide_kernel<T><<<tiles, 256, 0, s>>>(xt, rows, cols, fp8_max, cuda_format(format), amax, codes,
                                                          codes_t, scale_inv);
      check_launch(kOp, "cast_transpose_wide_kernel");
    }
  });
}

}  // namespace kiln::cuda

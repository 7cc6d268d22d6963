// FP8 quantize kernels (contract in ops/fp8/fp8_quantize_cuda.h). Every step copies the CPU
// emulation's arithmetic (ops/fp8/fp8_scaling.cpp) so the codes and inverse scales are the
// same bits: amax is a max (exact in any order, so atomics and shuffles keep it
// deterministic); the scale and cast are fp8_cast.cuh's (shared with the experts' kernels).
#include "ops/fp8/fp8_quantize_cuda.h"

#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "core/error.h"
#include "ops/fp8/fp8_cast.cuh"

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>

namespace kiln::cuda {

namespace {

using bf16 = __nv_bfloat16;
using ops::fp8::BlockShape;
using ops::fp8::Format;

constexpr int kTile = 32;        // tensorwise cast: 32 x 32 tiles (transposed through shared memory)
constexpr int kTileRows = 8;     // ... by 32 x 8 threads, four rows each
constexpr int kAmaxThreads = 256;
constexpr unsigned kAmaxBlocksMax = 1024;
constexpr int64_t kBlock = 128;  // DeepSeek-V3's block edge

__device__ __forceinline__ float ld(const float* p) { return *p; }
__device__ __forceinline__ float ld(const bf16* p) { return __bfloat162float(*p); }

using fp8_cast::cast;
using fp8_cast::cast8;
using fp8_cast::scale_from_amax;

__device__ __forceinline__ float warp_max(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Max over the block (blockDim.x a multiple of 32, at most 1024), returned to every thread.
__device__ float block_max(float v) {
  __shared__ float warps[32];
  __shared__ float result;
  v = warp_max(v);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warps[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float m = lane < static_cast<int>(blockDim.x / 32) ? warps[lane] : 0.0f;
    m = warp_max(m);
    if (lane == 0) result = m;
  }
  __syncthreads();
  return result;
}

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

__device__ __forceinline__ void load8(const float* p, float v[8]) {
  const float4 a = *reinterpret_cast<const float4*>(p), b = *reinterpret_cast<const float4*>(p + 4);
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

__device__ __forceinline__ void load8(const bf16* p, float v[8]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
  for (int j = 0; j < 4; ++j) {
    const float2 f = __bfloat1622float2(pairs[j]);
    v[2 * j] = f.x, v[2 * j + 1] = f.y;
  }
}

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

__host__ __device__ bool aligned_to(const void* p, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// 1 x 128 tiles: a warp per tile, four elements a lane.
template <typename T>
__global__ void tile_1x128_kernel(const T* x, int64_t rows, int64_t cols, int64_t tiles_per_row, float fp8_max,
                                  __nv_fp8_interpretation_t format, uint8_t* codes, float* scale_inv) {
  const int64_t tile = (blockIdx.x * int64_t{blockDim.x} + threadIdx.x) / 32;
  if (tile >= rows * tiles_per_row) return;  // whole warps leave together
  const int lane = threadIdx.x % 32;
  const int64_t row = tile / tiles_per_row, kb = tile % tiles_per_row;
  const int64_t first = row * cols + kb * kBlock, width = min(kBlock, cols - kb * kBlock);
  float v[4];
  float m = 0.0f;
  for (int j = 0; j < 4; ++j) {
    const int64_t c = lane + 32 * j;
    v[j] = c < width ? ld(x + first + c) : 0.0f;
    m = fmaxf(m, fabsf(v[j]));
  }
  const float scale = scale_from_amax(warp_max(m), fp8_max);
  if (lane == 0) scale_inv[kb * rows + row] = __fdiv_rn(1.0f, scale);
  for (int j = 0; j < 4; ++j) {
    const int64_t c = lane + 32 * j;
    if (c < width) codes[first + c] = cast(v[j], scale, format);
  }
}

// 128 x 128 blocks: a block of 256 threads per block, thread t on column t % 128 and every
// second row; the row stride of scale_inv is round_up(L, 4), its padding written as 1.
// With codes_t, the block's codes also go through shared memory to the transposed matrix
// [cols, rows] (coalesced), whose 128 x 128 blocks are these blocks transposed: the same
// amax, so the same scale, at the transposed place of scale_inv_t.
constexpr int kBlockThreads = 256;

__device__ void write_scale(float* scale_inv, int64_t stride, int64_t block_row, int64_t block_col,
                            int64_t block_cols, float value) {
  scale_inv[block_row * stride + block_col] = value;
  if (block_col == block_cols - 1)
    for (int64_t pad = block_cols; pad < stride; ++pad) scale_inv[block_row * stride + pad] = 1.0f;
}

template <typename T>
__global__ void block_128x128_kernel(const T* x, int64_t rows, int64_t cols, float fp8_max,
                                     __nv_fp8_interpretation_t format, uint8_t* codes, float* scale_inv,
                                     uint8_t* codes_t, float* scale_inv_t) {
  __shared__ uint8_t tile[kBlock][kBlock + 4];
  const int64_t rb = blockIdx.y, kb = blockIdx.x;
  const int64_t block_rows = gridDim.y, block_cols = gridDim.x;
  const int lane_col = threadIdx.x % kBlock;
  const int64_t col = kb * kBlock + lane_col;
  const int64_t row_first = rb * kBlock + threadIdx.x / kBlock;
  const int64_t row_end = min(rows, (rb + 1) * kBlock);
  constexpr int kRowStep = kBlockThreads / kBlock;
  float m = 0.0f;
  if (col < cols)
    for (int64_t r = row_first; r < row_end; r += kRowStep) m = fmaxf(m, fabsf(ld(x + r * cols + col)));
  const float scale = scale_from_amax(block_max(m), fp8_max);
  if (threadIdx.x == 0) {
    const float inv = __fdiv_rn(1.0f, scale);
    write_scale(scale_inv, (block_cols + 3) / 4 * 4, rb, kb, block_cols, inv);
    if (scale_inv_t != nullptr) write_scale(scale_inv_t, (block_rows + 3) / 4 * 4, kb, rb, block_rows, inv);
  }
  if (col < cols)
    for (int64_t r = row_first; r < row_end; r += kRowStep) {
      const uint8_t c = cast(ld(x + r * cols + col), scale, format);
      if (codes != nullptr) codes[r * cols + col] = c;
      tile[r - rb * kBlock][lane_col] = c;
    }
  if (codes_t == nullptr) return;
  __syncthreads();
  // codes_t row kb * 128 + i holds column i of this block; its columns are rows rb * 128 + lane_col.
  const int64_t t_col = rb * kBlock + lane_col;
  for (int i = threadIdx.x / kBlock; i < kBlock; i += kRowStep) {
    const int64_t t_row = kb * kBlock + i;
    if (t_row < cols && t_col < rows) codes_t[t_row * rows + t_col] = tile[lane_col][i];
  }
}

// x's 128 x 1 column tiles, written transposed: codes_t [cols, rows], whose 1 x 128 tiles
// (along rows) these are, with their scales in that operand's VEC128 layout (kb * cols + c):
// the weight gradient's K-major operands, K being the tokens. A block per 128 rows x 32
// columns, 256 threads: thread (c, r0) reads column c at rows r0, r0 + 8, ... (coalesced
// across c), the 8 warps' maxima meet in shared memory, and the codes go out through shared
// memory as 16-byte runs of a transposed row.
constexpr int kColumnTileWidth = 32;

template <typename T>
__global__ void __launch_bounds__(256)
    column_tiles_transposed_kernel(const T* x, int64_t rows, int64_t cols, float fp8_max,
                                   __nv_fp8_interpretation_t format, uint8_t* codes_t, float* scale_inv_t) {
  constexpr int kRowsPerThread = kBlock / 8;
  __shared__ float column_max[8][kColumnTileWidth];
  __shared__ alignas(16) uint8_t tile[kColumnTileWidth][kBlock + 16];  // [column][row]
  const int c = threadIdx.x % kColumnTileWidth, r0 = threadIdx.x / kColumnTileWidth;
  const int64_t kb = blockIdx.y, col = int64_t{blockIdx.x} * kColumnTileWidth + c, row_base = kb * kBlock;
  const int height = static_cast<int>(min(kBlock, rows - row_base));
  float v[kRowsPerThread];
  float m = 0.0f;
  for (int j = 0; j < kRowsPerThread; ++j) {
    const int i = r0 + 8 * j;
    v[j] = i < height && col < cols ? ld(x + (row_base + i) * cols + col) : 0.0f;
    m = fmaxf(m, fabsf(v[j]));
  }
  column_max[r0][c] = m;
  __syncthreads();
  float amax = 0.0f;
  for (int w = 0; w < 8; ++w) amax = fmaxf(amax, column_max[w][c]);
  const float scale = scale_from_amax(amax, fp8_max);
  if (r0 == 0 && col < cols) scale_inv_t[kb * cols + col] = __fdiv_rn(1.0f, scale);
  for (int j = 0; j < kRowsPerThread; ++j) tile[c][r0 + 8 * j] = cast(v[j], scale, format);
  __syncthreads();
  // Transposed row t_row (x's column), bytes row_base + first .. + 16: eight threads a row.
  const int t = threadIdx.x / 8, first = 16 * (threadIdx.x % 8);
  const int64_t t_row = int64_t{blockIdx.x} * kColumnTileWidth + t;
  if (t_row >= cols || first >= height) return;
  uint8_t* dst = codes_t + t_row * rows + row_base + first;
  if (first + 16 <= height && aligned_to(dst, 16)) {
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(&tile[t][first]);
  } else {
    for (int j = 0; first + j < height && j < 16; ++j) dst[j] = tile[t][first + j];
  }
}

__nv_fp8_interpretation_t cuda_format(Format format) { return format == Format::e4m3 ? __NV_E4M3 : __NV_E5M2; }

template <typename Fn>
void by_dtype(const char* op, DType dtype, Fn&& fn) {
  if (dtype == DType::f32) fn.template operator()<float>();
  else if (dtype == DType::bf16) fn.template operator()<bf16>();
  else fail(op, "input dtype {} (expected f32 or bf16)", dtype_name(dtype));
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

bool same(BlockShape x, BlockShape y) { return x.rows == y.rows && x.cols == y.cols; }
bool is_tile(BlockShape b) { return same(b, ops::fp8::kActivationTile); }
bool is_block(BlockShape b) { return same(b, ops::fp8::kWeightBlock); }

void check_block(const char* op, BlockShape block) {
  KILN_CHECK(is_tile(block) || is_block(block), op,
             "block shape [{}, {}]: cuBLASLt scales 1 x 128 tiles or 128 x 128 blocks", block.rows, block.cols);
}

}  // namespace

int64_t blockwise_scale_count(int64_t rows, int64_t cols, BlockShape block) {
  check_block("fp8_quantize", block);
  const int64_t l = ceil_div(cols, kBlock);
  return is_tile(block) ? l * rows : ceil_div(rows, kBlock) * ceil_div(l, 4) * 4;
}

int64_t blockwise_scale_index(int64_t rows, int64_t cols, BlockShape block, int64_t block_row, int64_t block_col) {
  check_block("fp8_quantize", block);
  if (is_tile(block)) return block_col * rows + block_row;
  return block_row * (ceil_div(ceil_div(cols, kBlock), 4) * 4) + block_col;
}

std::vector<float> blockwise_scale_layout(const ops::fp8::ScaledMatrix& q) {
  std::vector<float> out(blockwise_scale_count(q.rows, q.cols, q.block), 1.0f);
  for (int64_t br = 0; br < q.block_grid_rows(); ++br)
    for (int64_t bc = 0; bc < q.block_grid_cols(); ++bc)
      out[blockwise_scale_index(q.rows, q.cols, q.block, br, bc)] = q.scale_inv[br * q.block_grid_cols() + bc];
  return out;
}

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

void fp8_quantize_blockwise(const ExecContext& ctx, DType dtype, const void* x, int64_t rows, int64_t cols,
                            BlockShape block, Format format, uint8_t* codes, float* scale_inv, uint8_t* codes_t,
                            float* scale_inv_t) {
  constexpr const char* kOp = "fp8_quantize_blockwise";
  check_block(kOp, block);
  KILN_CHECK((codes_t == nullptr) == (scale_inv_t == nullptr), kOp, "codes_t and scale_inv_t come together");
  KILN_CHECK(codes != nullptr || codes_t != nullptr, kOp, "neither codes nor codes_t is given");
  KILN_CHECK(is_tile(block) ? (codes == nullptr) == (scale_inv == nullptr) : scale_inv != nullptr, kOp,
             "codes and scale_inv come together (128 x 128 blocks always write scale_inv)");
  KILN_CHECK(rows > 0 && cols > 0, kOp, "matrix [{}, {}] must not be empty", rows, cols);
  const cudaStream_t s = stream(ctx);
  const float fp8_max = ops::fp8::info(format).max;
  const int64_t l = ceil_div(cols, kBlock);
  by_dtype(kOp, dtype, [&]<typename T>() {
    const T* xt = static_cast<const T*>(x);
    if (is_tile(block)) {
      constexpr int kThreads = 256;  // eight tiles a block
      if (codes != nullptr) {
        tile_1x128_kernel<T><<<blocks_for(rows * l * 32, kThreads), kThreads, 0, s>>>(xt, rows, cols, l, fp8_max,
                                                                                    cuda_format(format), codes,
                                                                                    scale_inv);
        check_launch(kOp, "tile_1x128_kernel");
      }
      if (codes_t != nullptr) {
        KILN_CHECK(ceil_div(rows, kBlock) <= 65535, kOp, "{} rows pass the grid's 65535 x 128 limit", rows);
        const dim3 grid(static_cast<unsigned>(ceil_div(cols, kColumnTileWidth)),
                        static_cast<unsigned>(ceil_div(rows, kBlock)));
        column_tiles_transposed_kernel<T><<<grid, 256, 0, s>>>(xt, rows, cols, fp8_max, cuda_format(format), codes_t,
                                                               scale_inv_t);
        check_launch(kOp, "column_tiles_transposed_kernel");
      }
    } else {
      KILN_CHECK(ceil_div(rows, kBlock) <= 65535, kOp, "{} rows pass the grid's 65535 x 128 limit", rows);
      const dim3 grid(static_cast<unsigned>(l), static_cast<unsigned>(ceil_div(rows, kBlock)));
      block_128x128_kernel<T><<<grid, kBlockThreads, 0, s>>>(xt, rows, cols, fp8_max, cuda_format(format), codes,
                                                             scale_inv, codes_t, scale_inv_t);
      check_launch(kOp, "block_128x128_kernel");
    }
  });
}

}  // namespace kiln::cuda

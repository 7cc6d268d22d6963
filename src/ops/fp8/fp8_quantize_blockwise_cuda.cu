// Blockwise FP8 quantize kernels (contract in ops/fp8/fp8_quantize_cuda.h): DeepSeek-V3's
// 1 x 128 tiles and 128 x 128 blocks, with the scale layouts cuBLASLt reads. Every step
// copies the CPU emulation's arithmetic (ops/fp8/fp8_scaling.cpp): each tile's or block's
// amax is a max (exact in any order, so shuffles, shared-memory atomics and any split of
// the work give the same bits); the scale and cast are fp8_cast.cuh's.

#include "ops/fp8/fp8_quantize_cuda.h"

#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "core/error.h"
#include "ops/fp8/fp8_cast.cuh"
#include "ops/fp8/fp8_quantize_common.cuh"

#include <cuda_bf16.h>
#include <cuda_fp8.h>

namespace kiln::cuda {

namespace {

using namespace fp8_quantize_detail;
using ops::fp8::BlockShape;
using ops::fp8::Format;

using fp8_cast::cast;
using fp8_cast::cast8;
using fp8_cast::scale_from_amax;

constexpr int64_t kBlock = 128;  // DeepSeek-V3's block edge

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

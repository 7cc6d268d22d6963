// Blockwise FP8 quantize kernels (contract in ops/fp8/fp8_quantize_cuda.h): DeepSeek-V3's
// 1 x 128 tiles and 128 x 128 blocks, with the scale layouts cuBLASLt reads. Every step
// copies the CPU emulation's arithmetic (ops/fp8/fp8_scaling.cpp): each tile's or block's
// amax is a max (exact in any order, so shuffles, shared-memory atomics and any split of
// the work give the same bits); the scale and cast are fp8_cast.cuh's.
//
// Two sets of kernels: the general ones (any shape, f32 or bf16, one element a thread a
// step) and the training path's (bf16, rows and cols multiples of 128, 16-byte aligned:
// every fp8_blockwise LinearLayer call, fp8_blockwise_linear_runs_fp8), which read x in
// 16-byte vectors, write codes in 8- or 16-byte stores, and get a tile's row tiles and its
// transposed column tiles from one read of x.
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

// ---- general kernels: any shape, f32 or bf16 ------------------------------------------------

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

// ---- the training path: bf16, rows and cols multiples of 128, 16-byte aligned -------------
// A block of 256 threads per 128 x 128 tile of x. Loading, thread t takes the 16-byte
// vectors (row 16 i + t / 16, columns 8 (t % 16) ..) for i < 8: a half-warp reads one
// row's 256 bytes (coalesced), and holds one row's whole 1 x 128 tile, so the row's amax is
// four shuffles. All eight loads are issued before any is used.
constexpr int kFastThreads = 256;
constexpr int kVectorsPerThread = kBlock * kBlock / 8 / kFastThreads;  // 8
constexpr int kRowsPerPass = kFastThreads / 16;                         // 16
// A staged row of codes: 144 bytes (36 words) puts the 16-byte stores of eight
// consecutive rows (a quarter-warp) on distinct banks, and keeps rows 16-byte aligned.
constexpr int kStagePitch = kBlock + 16;

__device__ __forceinline__ float half_warp_max(float v) {
  for (int offset = 8; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

__device__ __forceinline__ void load_tile(const bf16* x, int64_t cols, int64_t row0, int64_t col0,
                                          uint4 raw[kVectorsPerThread]) {
  const int chunk = threadIdx.x % 16, r = threadIdx.x / 16;
  for (int i = 0; i < kVectorsPerThread; ++i)
    raw[i] = *reinterpret_cast<const uint4*>(x + (row0 + r + kRowsPerPass * i) * cols + col0 + 8 * chunk);
}

// 16 codes packed little-endian (code j at byte j) from 16 values.
__device__ __forceinline__ uint4 cast16(const float v[16], float scale, __nv_fp8_interpretation_t format) {
  const uint2 lo = cast8(v, scale, format), hi = cast8(v + 8, scale, format);
  return make_uint4(lo.x, lo.y, hi.x, hi.y);
}

// The x half of the shared memory the column tiles need: the 128 x 128 bf16 tile (32 KiB),
// 64 staged transposed rows of codes (one half of the columns at a time, 9 KiB) and the
// columns' amax bits (non-negative floats order as their bits, so an unsigned atomicMax
// is the float max). Dynamic (41.5 KiB, under the 48 KiB default): tiles alone take none.
struct ColumnStage {
  alignas(16) bf16 x[kBlock][kBlock];
  alignas(16) uint8_t codes_t[kBlock / 2][kStagePitch];
  unsigned column_amax[kBlock];
};
static_assert(sizeof(ColumnStage) <= 48 * 1024, "past the dynamic shared memory default: needs the opt-in attribute");

// 1 x 128 row tiles (codes, scale_inv; either both or neither) and, with kColumns, the
// transposed 128 x 1 column tiles (codes_t, scale_inv_t), from one read of x: what
// tile_1x128_kernel and column_tiles_transposed_kernel write, the same bits. The backward's
// dy takes both; the forward's x the row tiles; the backward's x the column tiles.
template <bool kColumns>
__global__ void __launch_bounds__(kFastThreads)
    tiles_bf16_kernel(const bf16* x, int64_t rows, int64_t cols, float fp8_max, __nv_fp8_interpretation_t format,
                      uint8_t* codes, float* scale_inv, uint8_t* codes_t, float* scale_inv_t) {
  extern __shared__ uint4 dynamic_smem[];
  ColumnStage& stage = *reinterpret_cast<ColumnStage*>(dynamic_smem);
  const int t = threadIdx.x, chunk = t % 16, r = t / 16;
  const int64_t row0 = blockIdx.y * kBlock, col0 = blockIdx.x * kBlock;
  if (kColumns && t < kBlock) stage.column_amax[t] = 0;
  uint4 raw[kVectorsPerThread];
  load_tile(x, cols, row0, col0, raw);
  float column_max[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // this thread's 8 columns over its 8 rows
  for (int i = 0; i < kVectorsPerThread; ++i) {
    float v[8];
    unpack8(raw[i], v);
    if constexpr (kColumns) {
      *reinterpret_cast<uint4*>(&stage.x[r + kRowsPerPass * i][8 * chunk]) = raw[i];
      for (int j = 0; j < 8; ++j) column_max[j] = fmaxf(column_max[j], fabsf(v[j]));
    }
    if (codes == nullptr) continue;  // uniform: the shuffles below see every lane or none
    float m = 0.0f;
    for (int j = 0; j < 8; ++j) m = fmaxf(m, fabsf(v[j]));
    const float scale = scale_from_amax(half_warp_max(m), fp8_max);
    const int64_t row = row0 + r + kRowsPerPass * i;
    if (chunk == 0) scale_inv[blockIdx.x * rows + row] = __fdiv_rn(1.0f, scale);
    *reinterpret_cast<uint2*>(codes + row * cols + col0 + 8 * chunk) = cast8(v, scale, format);
  }
  if constexpr (kColumns) {
    // Lanes l and l ^ 16 hold the same columns (rows 2w and 2w + 1 of each pass).
    for (int j = 0; j < 8; ++j) column_max[j] = fmaxf(column_max[j], __shfl_xor_sync(0xffffffffu, column_max[j], 16));
    __syncthreads();  // column_amax zeroed
    if (t % 32 < 16)
      for (int j = 0; j < 8; ++j) atomicMax(&stage.column_amax[8 * chunk + j], __float_as_uint(column_max[j]));
    __syncthreads();  // column_amax complete, the bf16 tile staged
    // Half h of the columns: thread (c, q) casts column 64 h + c at rows 32 q .. + 32 (a warp
    // reads 32 consecutive bf16 of a row: no bank conflicts) into its staged transposed row;
    // then eight threads copy each staged row out as one 128-byte run of codes_t.
    const int c = t % 64, q = t / 64;
    for (int h = 0; h < 2; ++h) {
      const int column = 64 * h + c;
      const float scale = scale_from_amax(__uint_as_float(stage.column_amax[column]), fp8_max);
      if (q == 0) scale_inv_t[blockIdx.y * cols + col0 + column] = __fdiv_rn(1.0f, scale);
      for (int k = 0; k < 2; ++k) {
        float v[16];
        for (int j = 0; j < 16; ++j) v[j] = __bfloat162float(stage.x[32 * q + 16 * k + j][column]);
        *reinterpret_cast<uint4*>(&stage.codes_t[c][32 * q + 16 * k]) = cast16(v, scale, format);
      }
      __syncthreads();
      for (int pass = 0; pass < 2; ++pass) {
        const int staged = t / 8 + 32 * pass, first = 16 * (t % 8);
        *reinterpret_cast<uint4*>(codes_t + (col0 + 64 * h + staged) * rows + row0 + first) =
            *reinterpret_cast<const uint4*>(&stage.codes_t[staged][first]);
      }
      if (h == 0) __syncthreads();  // the staged rows are read before the second half overwrites them
    }
  }
}

// 128 x 128 blocks, a block of 256 threads each: block_128x128_kernel's bits with 16-byte
// loads and 8-byte code stores. The transposed copy goes through shared memory twice:
// the codes staged row-major, each thread gathers 64 bytes of one column (a warp reads 32
// consecutive bytes of a row: no bank conflicts), then writes them back as a staged
// transposed row, which eight threads copy out as one 128-byte run of codes_t.
__global__ void __launch_bounds__(kFastThreads)
    block_128x128_bf16_kernel(const bf16* x, int64_t rows, int64_t cols, float fp8_max,
                              __nv_fp8_interpretation_t format, uint8_t* codes, float* scale_inv, uint8_t* codes_t,
                              float* scale_inv_t) {
  __shared__ alignas(16) uint8_t tile[kBlock][kStagePitch];
  const int t = threadIdx.x, chunk = t % 16, r = t / 16;
  const int64_t rb = blockIdx.y, kb = blockIdx.x, row0 = rb * kBlock, col0 = kb * kBlock;
  uint4 raw[kVectorsPerThread];
  load_tile(x, cols, row0, col0, raw);
  float m = 0.0f;
  for (int i = 0; i < kVectorsPerThread; ++i) {
    float v[8];
    unpack8(raw[i], v);
    for (int j = 0; j < 8; ++j) m = fmaxf(m, fabsf(v[j]));
  }
  const float scale = scale_from_amax(block_max(m), fp8_max);
  if (t == 0) {
    const float inv = __fdiv_rn(1.0f, scale);
    write_scale(scale_inv, (gridDim.x + 3) / 4 * 4, rb, kb, gridDim.x, inv);
    if (scale_inv_t != nullptr) write_scale(scale_inv_t, (gridDim.y + 3) / 4 * 4, kb, rb, gridDim.y, inv);
  }
  for (int i = 0; i < kVectorsPerThread; ++i) {
    float v[8];
    unpack8(raw[i], v);
    const uint2 packed = cast8(v, scale, format);
    const int row = r + kRowsPerPass * i;
    if (codes != nullptr) *reinterpret_cast<uint2*>(codes + (row0 + row) * cols + col0 + 8 * chunk) = packed;
    if (codes_t != nullptr) *reinterpret_cast<uint2*>(&tile[row][8 * chunk]) = packed;
  }
  if (codes_t == nullptr) return;
  __syncthreads();
  const int column = t % kBlock, half = t / kBlock;  // column's bytes at rows 64 half .. + 64
  uint4 gathered[4];
  for (int k = 0; k < 4; ++k) {
    uint32_t word[4] = {0, 0, 0, 0};
    for (int j = 0; j < 16; ++j) word[j / 4] |= uint32_t{tile[64 * half + 16 * k + j][column]} << (8 * (j % 4));
    gathered[k] = make_uint4(word[0], word[1], word[2], word[3]);
  }
  __syncthreads();  // every column gathered before the tile is overwritten transposed
  for (int k = 0; k < 4; ++k) *reinterpret_cast<uint4*>(&tile[column][64 * half + 16 * k]) = gathered[k];
  __syncthreads();
  for (int pass = 0; pass < 4; ++pass) {
    const int staged = t / 8 + 32 * pass, first = 16 * (t % 8);
    *reinterpret_cast<uint4*>(codes_t + (col0 + staged) * rows + row0 + first) =
        *reinterpret_cast<const uint4*>(&tile[staged][first]);
  }
}

bool same(BlockShape x, BlockShape y) { return x.rows == y.rows && x.cols == y.cols; }
bool is_tile(BlockShape b) { return same(b, ops::fp8::kActivationTile); }
bool is_block(BlockShape b) { return same(b, ops::fp8::kWeightBlock); }

void check_block(const char* op, BlockShape block) {
  KILN_CHECK(is_tile(block) || is_block(block), op,
             "block shape [{}, {}]: cuBLASLt scales 1 x 128 tiles or 128 x 128 blocks", block.rows, block.cols);
}

// The training path's kernels take the shape: bf16, whole 128 x 128 tiles, x and codes_t
// 16-byte aligned (their vector loads and stores), codes 8-byte.
bool fast_path(DType dtype, const void* x, int64_t rows, int64_t cols, const uint8_t* codes, const uint8_t* codes_t) {
  return dtype == DType::bf16 && rows % kBlock == 0 && cols % kBlock == 0 && rows / kBlock <= 65535 &&
         cols / kBlock <= 65535 && aligned_to(x, 16) && aligned_to(codes, 8) && aligned_to(codes_t, 16);
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
                            float* scale_inv_t, bool vector_kernels) {
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
  if (vector_kernels && fast_path(dtype, x, rows, cols, codes, codes_t)) {
    const bf16* xb = static_cast<const bf16*>(x);
    const dim3 grid(static_cast<unsigned>(cols / kBlock), static_cast<unsigned>(rows / kBlock));
    if (is_block(block)) {
      block_128x128_bf16_kernel<<<grid, kFastThreads, 0, s>>>(xb, rows, cols, fp8_max, cuda_format(format), codes,
                                                              scale_inv, codes_t, scale_inv_t);
      check_launch(kOp, "block_128x128_bf16_kernel");
    } else if (codes_t != nullptr) {
      tiles_bf16_kernel<true><<<grid, kFastThreads, sizeof(ColumnStage), s>>>(
          xb, rows, cols, fp8_max, cuda_format(format), codes, scale_inv, codes_t, scale_inv_t);
      check_launch(kOp, "tiles_bf16_kernel<columns>");
    } else {
      tiles_bf16_kernel<false><<<grid, kFastThreads, 0, s>>>(xb, rows, cols, fp8_max, cuda_format(format), codes,
                                                             scale_inv, nullptr, nullptr);
      check_launch(kOp, "tiles_bf16_kernel");
    }
    return;
  }
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

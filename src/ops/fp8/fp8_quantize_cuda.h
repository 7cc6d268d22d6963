// FP8 quantize kernels (fp8_quantize_cuda.cu): amax, scale and cast of a row-major
// [rows, cols] matrix (f32 or bf16) into e4m3 or e5m2 codes, bit for bit what the CPU
// emulation gives (ops/fp8/fp8_scaling.h: scale = fp8_max / amax with __fdiv_rn, x * scale
// rounded to fp32, cvt.rn.satfinite, scale_inv = 1 / scale). Nothing synchronizes with the
// host and nothing is allocated: the scales are computed on the device, so these run inside
// CUDA graph capture. Inputs must be finite (the CPU reference refuses others; here a NaN
// or inf gives an unspecified scale). Training calls them through ops/fp8/fp8_linear.h.
//
// Operands are laid out for cuBLASLt's FP8 GEMM (ops/fp8/fp8_gemm_cuda.h): K (the GEMM's
// reduction dimension) is `cols`, the contiguous one, and a block-scaled operand's
// scale_inv array is in the layout cuBLASLt's VEC128_32F / BLK128x128_32F modes read
// (blockwise_scale_index below).
#pragma once

#include "core/dtype.h"
#include "core/exec_context.h"
#include "ops/fp8/fp8_scaling.h"

#include <cstdint>
#include <vector>

namespace kiln::cuda {

// Tensorwise current scaling (Transformer Engine's, no amax history): one scale for the
// whole matrix. Writes *amax (max |x|), *scale_inv, codes [rows, cols] and/or codes_t, the
// transposed codes [cols, rows] (the K-major operand the backward needs), in the same pass
// with the same scale; either may be null (not both). amax, scale_inv: one device float each.
// amax_ready: *amax already holds max |x| (its producer wrote it, e.g. ops::swiglu_forward),
// so the amax pass is skipped and only the cast reads x.
void fp8_quantize_tensorwise(const ExecContext& ctx, DType dtype, const void* x, int64_t rows, int64_t cols,
                             ops::fp8::Format format, uint8_t* codes, uint8_t* codes_t, float* amax,
                             float* scale_inv, bool amax_ready = false);

// `batch` matrices [rows, cols] stored one after another (x + b rows cols, the same for
// codes and codes_t), each quantized as fp8_quantize_tensorwise quantizes it alone (its own
// amax[b] and scale_inv[b]; the same bits), in two launches for all of them instead of
// three each: the experts' weights, one scale per expert. Takes the wide kernels' shapes
// only: rows a multiple of 16, cols of 8, x 16-byte aligned (grouped_fp8 checks them).
void fp8_quantize_tensorwise_batched(const ExecContext& ctx, DType dtype, const void* x, int64_t batch, int64_t rows,
                                     int64_t cols, ops::fp8::Format format, uint8_t* codes, uint8_t* codes_t,
                                     float* amax, float* scale_inv);

// DeepSeek-V3 blockwise scaling: `block` is ops::fp8::kActivationTile (1 x 128 along cols)
// or kWeightBlock (128 x 128); a partial block at an edge is its own. codes [rows, cols];
// scale_inv holds blockwise_scale_count(rows, cols, block) floats in cuBLASLt's layout
// (padding entries are written as 1). codes_t and scale_inv_t (both or neither) get the
// transposed operand [cols, rows] with its blockwise_scale_count(cols, rows, block) scales:
//   128 x 128 blocks: the weight's K-major copy for the backward's dgrad, the same blocks
//                     transposed, so the same scales;
//   1 x 128 tiles:    the transposed matrix's own 1 x 128 tiles (128 x 1 column tiles of x,
//                     scales of their own): the weight gradient's operands, whose K is the
//                     rows (tokens).
// codes may be null when codes_t is given: x's own codes are not written (for 1 x 128
// tiles nor their scale_inv, which is then null too; 128 x 128 blocks still write theirs).
// vector_kernels: bf16 whole 128-blocks (16-byte aligned) take kernels with 16-byte vector
// loads that make a tile's row tiles and transposed column tiles from one read (the same
// bits; the training default, train.fp8_blockwise_kernels). Other shapes and dtypes take
// the general kernels either way.
void fp8_quantize_blockwise(const ExecContext& ctx, DType dtype, const void* x, int64_t rows, int64_t cols,
                            ops::fp8::BlockShape block, ops::fp8::Format format, uint8_t* codes, float* scale_inv,
                            uint8_t* codes_t = nullptr, float* scale_inv_t = nullptr, bool vector_kernels = false);

// cuBLASLt's scale layouts for an operand [rows, K] stored K-major (docs/fp8.md), with
// kb = k / 128 and L = ceil(K / 128):
//   1 x 128   (VEC128_32F):     [L, rows]: scale (r, kb) at kb * rows + r
//   128 x 128 (BLK128x128_32F): [ceil(rows / 128), round_up(L, 4)]: scale (rb, kb) at
//                               rb * round_up(L, 4) + kb (the row stride padded to 4)
int64_t blockwise_scale_count(int64_t rows, int64_t cols, ops::fp8::BlockShape block);
int64_t blockwise_scale_index(int64_t rows, int64_t cols, ops::fp8::BlockShape block, int64_t block_row,
                              int64_t block_col);
// The CPU reference's row-major scale_inv grid rearranged into that layout (padding 1):
// what fp8_quantize_blockwise writes, and what fp8_gemm takes from reference operands.
std::vector<float> blockwise_scale_layout(const ops::fp8::ScaledMatrix& q);

}  // namespace kiln::cuda

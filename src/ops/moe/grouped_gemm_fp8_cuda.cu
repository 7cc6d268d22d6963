// The experts' FP8 quantize steps (grouped_gemm_fp8_cuda.h). The casts are
// fp8_quantize_cuda.h's (the CPU emulation's bits); what is grouped-specific here is the
// amax over the live rows only (a device row count), the per-expert weight scales and the
// padded transpose for the weight gradient's K-major operands.
#include "ops/moe/grouped_gemm_fp8_cuda.h"

#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "core/error.h"
#include "ops/bf16_vector.cuh"
#include "ops/fp8/fp8_quantize_cuda.h"
#include "ops/moe/grouped_gemm_fp8_sm90.h"

#include <cuda_bf16.h>

#include <algorithm>

namespace kiln::cuda {

namespace {

constexpr const char* kOp = "moe_grouped_linear_fp8";
constexpr int kAmaxThreads = 256;
constexpr unsigned kAmaxBlocksMax = 1024;
constexpr int kTile = 32, kTileRows = 8;

__device__ float block_max(float v) {
  __shared__ float warps[32];
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warps[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < static_cast<int>(blockDim.x / 32) ? warps[lane] : 0.0f;
    for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  }
  return v;  // thread 0's is the block's
}

// max |x| over the first offsets[E] rows; joined across blocks by an unsigned atomicMax of
// the float bits (non-negative floats order as their bits): a max, so any order gives it.
__global__ void __launch_bounds__(kAmaxThreads)
    live_rows_amax(const __nv_bfloat16* __restrict__ x, const int32_t* __restrict__ live_rows, int64_t cols,
                   float* amax) {
  const int64_t n = static_cast<int64_t>(*live_rows) * cols;
  float m = 0.0f;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    m = fmaxf(m, fabsf(__bfloat162float(x[i])));
  m = block_max(m);
  if (threadIdx.x == 0) atomicMax(reinterpret_cast<unsigned*>(amax), __float_as_uint(m));
}

__global__ void padded_offsets_kernel(const int32_t* __restrict__ offsets, int64_t experts, int32_t* padded) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  int32_t at = 0;
  padded[0] = 0;
  for (int64_t e = 0; e < experts; ++e) {
    const int32_t n = offsets[e + 1] - offsets[e];
    at += (n + 15) / 16 * 16;
    padded[e + 1] = at;
  }
}

// The expert owning live row r: the largest e with offsets[e] <= r (empty experts before it
// share its offset).
__device__ int64_t expert_of_row(const int32_t* __restrict__ offsets, int64_t experts, int64_t r) {
  int64_t lo = 0, hi = experts;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (offsets[mid] <= r) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// 32 x 32 tiles through shared memory: read along the row's columns, write along the rows
// (contiguous within an expert).
__global__ void __launch_bounds__(kTile* kTileRows)
    transpose_padded_kernel(const uint8_t* __restrict__ codes, const int32_t* __restrict__ offsets,
                            const int32_t* __restrict__ padded, int64_t experts, int64_t cols, int64_t ld,
                            uint8_t* __restrict__ out) {
  __shared__ uint8_t tile[kTile][kTile + 1];
  const int64_t live = offsets[experts];
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kTile, c0 = static_cast<int64_t>(blockIdx.y) * kTile;
  if (r0 >= live) return;  // the whole block
  const int tx = threadIdx.x, ty = threadIdx.y;
  for (int i = ty; i < kTile; i += kTileRows) {
    const int64_t r = r0 + i, c = c0 + tx;
    tile[i][tx] = r < live && c < cols ? codes[r * cols + c] : 0;
  }
  __syncthreads();
  const int64_t r = r0 + tx;
  if (r >= live) return;
  const int64_t e = expert_of_row(offsets, experts, r);
  const int64_t pos = padded[e] + (r - offsets[e]);
  for (int i = ty; i < kTile; i += kTileRows) {
    const int64_t c = c0 + i;
    if (c < cols) out[c * ld + pos] = tile[tx][i];
  }
}

}  // namespace

bool grouped_fp8_supported(int64_t in, int64_t out, std::initializer_list<const void*> bases) {
  if (in % 16 != 0 || out % 16 != 0 || in == 0 || out == 0 || !sm90::grouped_gemm_fp8_available()) return false;
  for (const void* p : bases)
    if (p != nullptr && !vec::aligned16(p)) return false;
  return true;
}

int64_t grouped_fp8_padded_ld(int64_t rows, int64_t experts) { return (rows + 15 * experts + 15) / 16 * 16; }

void grouped_fp8_quantize_rows(const ExecContext& ctx, const bf16_bits* x, const int32_t* offsets, int64_t experts,
                               int64_t rows, int64_t cols, ops::fp8::Format format, uint8_t* codes, float* amax,
                               float* scale_inv) {
  check(cudaMemsetAsync(amax, 0, sizeof(float), stream(ctx)), kOp, "cudaMemsetAsync amax");
  const int64_t n = rows * cols;
  const unsigned blocks =
      static_cast<unsigned>(std::clamp<int64_t>((n + kAmaxThreads - 1) / kAmaxThreads, 1, kAmaxBlocksMax));
  live_rows_amax<<<blocks, kAmaxThreads, 0, stream(ctx)>>>(reinterpret_cast<const __nv_bfloat16*>(x), offsets + experts,
                                                           cols, amax);
  check_launch(kOp, "live_rows_amax");
  fp8_quantize_tensorwise(ctx, DType::bf16, x, rows, cols, format, codes, nullptr, amax, scale_inv, /*amax_ready=*/true);
}

void grouped_fp8_quantize_weights(const ExecContext& ctx, const bf16_bits* w, int64_t experts, int64_t in, int64_t out,
                                  uint8_t* codes, uint8_t* codes_t, float* amax, float* scale_inv) {
  // Each expert's weight quantized as a tensor of its own (its own amax and scale; the
  // transposed copy from the same pass), all experts in two launches. A launch or three per
  // expert (64 at bench-moe-1b) made the step 1.6x bf16's (H100, 2026-12-07).
  if (in % 8 == 0 && out % 16 == 0 && vec::aligned16(w)) {
    fp8_quantize_tensorwise_batched(ctx, DType::bf16, w, experts, out, in, ops::fp8::Format::e4m3, codes, codes_t,
                                    amax, scale_inv);
    return;
  }
  const int64_t size = out * in;
  for (int64_t e = 0; e < experts; ++e)
    fp8_quantize_tensorwise(ctx, DType::bf16, w + e * size, out, in, ops::fp8::Format::e4m3,
                            codes ? codes + e * size : nullptr, codes_t ? codes_t + e * size : nullptr, amax + e,
                            scale_inv + e);
}

void grouped_fp8_padded_offsets(const ExecContext& ctx, const int32_t* offsets, int64_t experts, int32_t* padded) {
  padded_offsets_kernel<<<1, 1, 0, stream(ctx)>>>(offsets, experts, padded);
  check_launch(kOp, "padded_offsets_kernel");
}

void grouped_fp8_transpose_padded(const ExecContext& ctx, const uint8_t* codes, const int32_t* offsets,
                                  const int32_t* padded, int64_t experts, int64_t rows, int64_t cols, int64_t ld,
                                  uint8_t* out) {
  check(cudaMemsetAsync(out, 0, static_cast<size_t>(cols * ld), stream(ctx)), kOp, "cudaMemsetAsync transposed codes");
  if (rows == 0 || cols == 0) return;
  const int64_t col_tiles = (cols + kTile - 1) / kTile;
  KILN_CHECK(col_tiles <= 65535, kOp, "{} columns", cols);
  const dim3 grid(static_cast<unsigned>((rows + kTile - 1) / kTile), static_cast<unsigned>(col_tiles));
  transpose_padded_kernel<<<grid, dim3(kTile, kTileRows), 0, stream(ctx)>>>(codes, offsets, padded, experts, cols, ld,
                                                                            out);
  check_launch(kOp, "transpose_padded_kernel");
}

}  // namespace kiln::cuda

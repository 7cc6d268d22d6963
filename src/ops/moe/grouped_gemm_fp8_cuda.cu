// The experts' FP8 quantize steps (grouped_gemm_fp8_cuda.h). The casts are
// fp8_quantize_cuda.h's or fp8_cast.cuh's arithmetic (the CPU emulation's bits); what is
// grouped-specific here is the amax over the live rows only (a device row count), the
// per-expert weight scales and the cast fused with the padded transpose for the weight
// gradient's K-major operands.
#include "ops/moe/grouped_gemm_fp8_cuda.h"

#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "core/error.h"
#include "ops/bf16_vector.cuh"
#include "ops/fp8/fp8_cast.cuh"
#include "ops/fp8/fp8_quantize_cuda.h"
#include "ops/moe/grouped_gemm_fp8_sm90.h"

#include <cuda_bf16.h>

#include <algorithm>

namespace kiln::cuda {

namespace {

constexpr const char* kOp = "moe_grouped_linear_fp8";
constexpr int kAmaxThreads = 256;
constexpr unsigned kAmaxBlocksMax = 1024;
constexpr int kPadTile = 64, kPadThreads = 256;  // cast_transpose_padded_kernel

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

// max |x| over the first offsets[E] rows, W consecutive elements a thread (8: one 16-byte
// load, when cols % 8 == 0 and x is 16-byte aligned; else 1); joined across blocks by an
// unsigned atomicMax of the float bits (non-negative floats order as their bits): a max, so
// any order gives it.
template <int W>
__global__ void __launch_bounds__(kAmaxThreads)
    live_rows_amax(const __nv_bfloat16* __restrict__ x, const int32_t* __restrict__ live_rows, int64_t cols,
                   float* amax) {
  const int64_t groups = static_cast<int64_t>(*live_rows) * cols / W;
  float m = 0.0f, v[W];
  for (int64_t g = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; g < groups;
       g += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    vec::load<W>(x + W * g, v);
    for (int j = 0; j < W; ++j) m = fmaxf(m, fabsf(v[j]));
  }
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

// The segment of bounds [E + 1] (ascending) holding i < bounds[E]: the largest e with
// bounds[e] <= i (empty segments before it share its bound).
__device__ int64_t segment_of(const int32_t* __restrict__ bounds, int64_t experts, int64_t i) {
  int64_t lo = 0, hi = experts;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (bounds[mid] <= i) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// The cast and the padded transpose in one pass, one tile a block of 256 threads: 64
// columns of codes_t (padded positions p0 ..) by 64 columns of x. Tiled over the output's
// positions rather than x's rows, every 16-byte store of codes_t lies in one expert's
// padded range (padded[e] is a multiple of 16), padding included, so the padding is written
// as zeros by the same stores and nothing else needs clearing. The first 64 threads find
// their position's source row once (the expert by a binary search over padded); then each
// thread casts 8 columns of two positions (16-byte loads, 8-byte row-major code stores for
// live rows), and after the tile is transposed in shared memory writes 16 bytes of a
// transposed row. cols % 8 == 0, ld % 16 == 0.
__global__ void __launch_bounds__(kPadThreads)
    cast_transpose_padded_kernel(const __nv_bfloat16* __restrict__ x, const int32_t* __restrict__ offsets,
                                 const int32_t* __restrict__ padded, int64_t experts, int64_t cols, int64_t ld,
                                 float fp8_max, __nv_fp8_interpretation_t format, const float* __restrict__ amax,
                                 uint8_t* __restrict__ codes, uint8_t* __restrict__ codes_t, float* scale_inv) {
  __shared__ uint8_t tile[kPadTile][kPadTile + 4];  // [position - p0][column - c0]
  __shared__ int64_t source[kPadTile];              // x's row at position p0 + i, or -1 (padding)
  const float scale = fp8_cast::scale_from_amax(*amax, fp8_max);
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *scale_inv = __fdiv_rn(1.0f, scale);
  const int64_t p0 = static_cast<int64_t>(blockIdx.x) * kPadTile, c0 = static_cast<int64_t>(blockIdx.y) * kPadTile;
  if (threadIdx.x < kPadTile) {
    const int64_t p = p0 + threadIdx.x;
    int64_t r = -1;
    if (p < padded[experts]) {
      const int64_t e = segment_of(padded, experts, p), k = p - padded[e];
      if (k < offsets[e + 1] - offsets[e]) r = offsets[e] + k;
    }
    source[threadIdx.x] = r;
  }
  __syncthreads();
  const int group = threadIdx.x % 8;  // 8 groups of 8 columns, 32 positions a pass
  const int64_t col = c0 + 8 * group;
  for (int i = threadIdx.x / 8; i < kPadTile; i += kPadThreads / 8) {
    const int64_t r = source[i];
    uint2 packed = make_uint2(0, 0);
    if (r >= 0 && col < cols) {
      float v[8];
      vec::load8(x + r * cols + col, v);
      packed = fp8_cast::cast8(v, scale, format);
      if (codes != nullptr) *reinterpret_cast<uint2*>(codes + r * cols + col) = packed;
    }
    *reinterpret_cast<uint32_t*>(&tile[i][8 * group]) = packed.x;
    *reinterpret_cast<uint32_t*>(&tile[i][8 * group + 4]) = packed.y;
  }
  __syncthreads();
  // codes_t [cols, ld]: transposed row c0 + c, bytes p0 + 16 h .. + 16.
  const int c = threadIdx.x / 4, h = threadIdx.x % 4;
  const int64_t t_row = c0 + c, t_col = p0 + 16 * h;
  if (t_row >= cols || t_col >= ld) return;
  uint32_t word[4] = {0, 0, 0, 0};
  for (int j = 0; j < 16; ++j) word[j / 4] |= uint32_t{tile[16 * h + j][c]} << (8 * (j % 4));
  *reinterpret_cast<uint4*>(codes_t + t_row * ld + t_col) = make_uint4(word[0], word[1], word[2], word[3]);
}

// *amax = max |x| over the live rows (zeroed first, on the stream).
void live_amax(const ExecContext& ctx, const bf16_bits* x, const int32_t* offsets, int64_t experts, int64_t rows,
               int64_t cols, float* amax) {
  check(cudaMemsetAsync(amax, 0, sizeof(float), stream(ctx)), kOp, "cudaMemsetAsync amax");
  const bool wide = cols % vec::kWidth == 0 && vec::aligned16(x);
  const int64_t groups = rows * cols / (wide ? vec::kWidth : 1);
  const unsigned blocks =
      static_cast<unsigned>(std::clamp<int64_t>((groups + kAmaxThreads - 1) / kAmaxThreads, 1, kAmaxBlocksMax));
  const auto* xb = reinterpret_cast<const __nv_bfloat16*>(x);
  if (wide) live_rows_amax<vec::kWidth><<<blocks, kAmaxThreads, 0, stream(ctx)>>>(xb, offsets + experts, cols, amax);
  else live_rows_amax<1><<<blocks, kAmaxThreads, 0, stream(ctx)>>>(xb, offsets + experts, cols, amax);
  check_launch(kOp, "live_rows_amax");
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
  live_amax(ctx, x, offsets, experts, rows, cols, amax);
  fp8_quantize_tensorwise(ctx, DType::bf16, x, rows, cols, format, codes, nullptr, amax, scale_inv, /*amax_ready=*/true);
}

void grouped_fp8_quantize_padded(const ExecContext& ctx, const bf16_bits* x, const int32_t* offsets,
                                 const int32_t* padded, int64_t experts, int64_t rows, int64_t cols, int64_t ld,
                                 ops::fp8::Format format, uint8_t* codes, uint8_t* codes_t, float* amax,
                                 float* scale_inv) {
  KILN_CHECK(rows > 0 && cols > 0 && cols % 8 == 0 && ld % 16 == 0 && ld >= grouped_fp8_padded_ld(rows, experts) &&
                 vec::aligned16(x) && vec::aligned16(codes) && vec::aligned16(codes_t) && codes_t != nullptr,
             kOp, "padded quantize of [{}, {}] into ld {}: needs cols % 8, ld % 16 and 16-byte aligned operands", rows,
             cols, ld);
  const int64_t col_tiles = (cols + kPadTile - 1) / kPadTile, pos_tiles = (ld + kPadTile - 1) / kPadTile;
  KILN_CHECK(col_tiles <= 65535 && pos_tiles <= 0x7fffffff, kOp, "{} columns, ld {}", cols, ld);
  live_amax(ctx, x, offsets, experts, rows, cols, amax);
  const __nv_fp8_interpretation_t fp8_format = format == ops::fp8::Format::e4m3 ? __NV_E4M3 : __NV_E5M2;
  const dim3 grid(static_cast<unsigned>(pos_tiles), static_cast<unsigned>(col_tiles));
  cast_transpose_padded_kernel<<<grid, kPadThreads, 0, stream(ctx)>>>(
      reinterpret_cast<const __nv_bfloat16*>(x), offsets, padded, experts, cols, ld, ops::fp8::info(format).max,
      fp8_format, amax, codes, codes_t, scale_inv);
  check_launch(kOp, "cast_transpose_padded_kernel");
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

}  // namespace kiln::cuda

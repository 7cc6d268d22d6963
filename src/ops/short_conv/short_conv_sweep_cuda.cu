// The short convolution's sweep kernels: block (one tile of tokens, 256 channels), a thread
// per channel sweeping the tile (ops/short_conv/short_conv_sweep.h); consecutive threads
// read consecutive channels of a row, so every row load is coalesced.
#include "ops/short_conv/short_conv_sweep_cuda.h"

#include "core/context_scratch.h"
#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "core/error.h"
#include "ops/ordered_partials.h"
#include "ops/short_conv/short_conv_sweep.h"

#include <cuda_bf16.h>

#include <algorithm>

namespace kiln::cuda {

namespace {

namespace sweep = short_conv_sweep;
using bf16 = __nv_bfloat16;

constexpr int kChannels = 256;       // threads a block, one channel each
constexpr int64_t kTileTokens = 64;  // a tile's tokens where the partial sums fit
constexpr int64_t kScratchFloats = int64_t{1} << 22;
constexpr ScratchKind kSweepPartials{"short_conv_sweep_backward", kScratchFloats * sizeof(float)};

__device__ __forceinline__ float ld(const float* p) { return *p; }
__device__ __forceinline__ float ld(const bf16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ void st(float* p, float v) { *p = v; }
__device__ __forceinline__ void st(bf16* p, float v) { *p = __float2bfloat16_rn(v); }

// Tiles by shape alone (so dw's order of sums is too): kTileTokens each, fewer where the
// backward's partial rows [tiles, ch, kernel] would pass the scratch.
int64_t tiles_for(int64_t n, int64_t ch, int64_t kernel) {
  const int64_t fit = kScratchFloats / (ch * kernel);
  return std::max<int64_t>(1, std::min((n + kTileTokens - 1) / kTileTokens, fit));
}

template <typename T>
__global__ void forward_kernel(const T* x, const T* w, const int32_t* cu, int64_t seqs, int64_t n, int64_t ch,
                               int K, int64_t tile, T* y) {
  const int64_t c = blockIdx.y * int64_t{kChannels} + threadIdx.x;
  if (c >= ch) return;
  const int64_t first = blockIdx.x * tile, last = min(n, first + tile);
  sweep::forward(
      cu, seqs, K, first, last, [&](int64_t t) { return ld(x + t * ch + c); },
      [&](int j) { return ld(w + c * K + j); }, [&](int64_t t, float v) { st(y + t * ch + c, v); });
}

template <typename T>
__global__ void backward_kernel(const T* x, const T* w, const int32_t* cu, int64_t seqs, int64_t n, int64_t ch,
                                int K, int64_t tile, const T* dy, T* dx, float* partials) {
  const int64_t c = blockIdx.y * int64_t{kChannels} + threadIdx.x;
  if (c >= ch) return;
  const int64_t first = blockIdx.x * tile, last = min(n, first + tile);
  float dw[sweep::kMaxTaps];
  sweep::backward(
      cu, seqs, n, K, first, last, [&](int64_t t) { return ld(x + t * ch + c); },
      [&](int j) { return ld(w + c * K + j); }, [&](int64_t t) { return ld(dy + t * ch + c); },
      [&](int64_t t, float v) { st(dx + t * ch + c, v); }, dw);
  if (partials == nullptr) return;
  for (int j = 0; j < K; ++j) partials[(blockIdx.x * ch + c) * K + j] = dw[j];
}

template <typename Fn>
void by_dtype(DType dtype, Fn&& fn) {
  if (dtype == DType::f32) fn.template operator()<float>();
  else fn.template operator()<bf16>();
}

void check_taps(const char* op, int64_t kernel) {
  KILN_CHECK(kernel >= 1 && kernel <= sweep::kMaxTaps, op, "kernel {} outside the sweep's 1..{} taps", kernel,
             sweep::kMaxTaps);
}

}  // namespace

void short_conv_sweep_forward(const ExecContext& ctx, DType dtype, const void* x, const void* w,
                              const int32_t* cu_seqlens, int64_t seqs, int64_t n, int64_t ch, int64_t kernel, void* y) {
  if (n * ch == 0) return;
  const char* op = "short_conv_forward";
  check_taps(op, kernel);
  const int64_t tiles = (n + kTileTokens - 1) / kTileTokens;
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>((ch + kChannels - 1) / kChannels));
  by_dtype(dtype, [&]<typename T>() {
    forward_kernel<T><<<grid, kChannels, 0, stream(ctx)>>>(static_cast<const T*>(x), static_cast<const T*>(w),
                                                           cu_seqlens, seqs, n, ch, static_cast<int>(kernel),
                                                           kTileTokens, static_cast<T*>(y));
  });
  check_launch(op, "short_conv_sweep forward_kernel");
}

void short_conv_sweep_backward(const ExecContext& ctx, DType dtype, const void* x, const void* w,
                               const int32_t* cu_seqlens, int64_t seqs, int64_t n, int64_t ch, int64_t kernel,
                               const void* dy, void* dx, float* dw) {
  if (n * ch == 0) return;
  const char* op = "short_conv_backward";
  check_taps(op, kernel);
  KILN_CHECK(ch * kernel <= kScratchFloats, op, "{} channels x {} taps exceed the partial sums' scratch", ch, kernel);
  const int64_t tiles = tiles_for(n, ch, kernel), tile = sweep::tile_length(n, tiles);
  float* partials = dw ? context_scratch_as<float>(ctx, kSweepPartials) : nullptr;
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>((ch + kChannels - 1) / kChannels));
  by_dtype(dtype, [&]<typename T>() {
    backward_kernel<T><<<grid, kChannels, 0, stream(ctx)>>>(
        static_cast<const T*>(x), static_cast<const T*>(w), cu_seqlens, seqs, n, ch, static_cast<int>(kernel), tile,
        static_cast<const T*>(dy), static_cast<T*>(dx), partials);
  });
  check_launch(op, "short_conv_sweep backward_kernel");
  if (!dw) return;
  add_partials(ctx, partials, tiles, ch * kernel, dw, op);
}

}  // namespace kiln::cuda

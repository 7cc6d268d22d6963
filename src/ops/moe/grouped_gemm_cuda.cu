// The experts' grouped products (grouped_gemm_cuda.h): the choice between CUTLASS's Hopper
// kernel (grouped_gemm_sm90.cu) and the portable tiled kernel below.
//
// The portable kernel: C_e (=, or += for the weight gradient) = A_e B_e per expert on
// 64 x 64 output tiles, K in steps of 16 through shared memory, 256 threads with a 4 x 4
// block of outputs each, fp32 FMAs in K order. Operands load as their own dtype (any
// alignment, any width), every sum is one thread's in a fixed order: the same bits every
// run. The three products differ only in where A, B and C live:
//   forward       M = n_e, N = out, K = in:   A = x_e,     B = W_e^T, C = y_e
//   input grad    M = n_e, N = in,  K = out:  A = dy_e,    B = W_e,   C = dx_e
//   weight grad   M = out, N = in,  K = n_e:  A = dy_e^T,  B = x_e,   C = dW_e (+=)
// Forward and input gradient have M from the device offsets: the grid covers the most tiles
// the experts can need (rows / 64 + E along x), and each block finds its expert and tile by
// walking the offsets; blocks past the last tile return. The weight gradient's grid is fixed
// (tiles of W_e along x, experts along y) and K comes from the offsets.
#include "ops/moe/grouped_gemm_cuda.h"

#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "core/error.h"
#include "ops/bf16_vector.cuh"
#include "ops/moe/grouped_gemm_sm90.h"

#include <cuda_bf16.h>

#include <atomic>

namespace kiln::cuda {

namespace {

using bf16 = __nv_bfloat16;
using vec::from_f32;
using vec::to_f32;

constexpr int kTileM = 64, kTileN = 64, kTileK = 16;
constexpr int kThreads = 256;
constexpr int kPerThread = 4;  // outputs per thread along M and along N

enum class Product { forward, input_grad, weight_grad };

// Where the three matrices of expert e live, and their extents.
template <typename T, Product P>
struct Operands {
  const T* a_base;  // x (forward), dy (both backwards)
  const T* b_base;  // w (forward, input grad), x (weight grad)
  int64_t in, out;

  // A_e(m, k) and B_e(k, n) for an expert whose rows start at `first`.
  __device__ __forceinline__ float a(int64_t e, int64_t first, int64_t m, int64_t k) const {
    if constexpr (P == Product::forward) return to_f32(a_base[(first + m) * in + k]);
    else if constexpr (P == Product::input_grad) return to_f32(a_base[(first + m) * out + k]);
    else return to_f32(a_base[(first + k) * out + m]);
  }
  __device__ __forceinline__ float b(int64_t e, int64_t first, int64_t k, int64_t n) const {
    if constexpr (P == Product::forward) return to_f32(b_base[(e * out + n) * in + k]);
    else if constexpr (P == Product::input_grad) return to_f32(b_base[(e * out + k) * in + n]);
    else return to_f32(b_base[(first + k) * in + n]);
  }
  // A is contiguous along M only for the weight gradient (dy_e^T); B along N except forward.
  static constexpr bool kAAlongM = P == Product::weight_grad;
  static constexpr bool kBAlongN = P != Product::forward;
};

// Finds the block's expert and M tile from the offsets (forward, input grad); false past
// the last tile.
__device__ bool find_row_tile(const int32_t* __restrict__ offsets, int64_t experts, int64_t tile, int64_t* e_out,
                              int64_t* first, int64_t* rows, int64_t* m0) {
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t begin = offsets[e], n = offsets[e + 1] - begin;
    const int64_t tiles = (n + kTileM - 1) / kTileM;
    if (tile < tiles) {
      *e_out = e, *first = begin, *rows = n, *m0 = tile * kTileM;
      return true;
    }
    tile -= tiles;
  }
  return false;
}

template <typename T, typename TC, Product P>
__global__ void __launch_bounds__(kThreads)
    grouped_gemm_kernel(Operands<T, P> ops, const int32_t* __restrict__ offsets, int64_t experts, int64_t n_total,
                        TC* __restrict__ c) {
  __shared__ float a_tile[kTileK][kTileM + 1];
  __shared__ float b_tile[kTileK][kTileN + 1];
  __shared__ int64_t where[4];  // expert, its first row, its rows, this tile's first M
  const int tid = threadIdx.x;
  int64_t e, first, m_extent, k_extent, m0, n0;
  if constexpr (P == Product::weight_grad) {
    e = blockIdx.y;
    first = offsets[e];
    k_extent = offsets[e + 1] - first;
    m_extent = ops.out;
    const int64_t n_tiles = (n_total + kTileN - 1) / kTileN;
    m0 = (blockIdx.x / n_tiles) * kTileM;
    n0 = (blockIdx.x % n_tiles) * kTileN;
    if (k_extent == 0) return;  // dW_e += 0
  } else {
    if (tid == 0) {
      int64_t found[4];
      where[0] = find_row_tile(offsets, experts, blockIdx.x, &found[0], &found[1], &found[2], &found[3]) ? found[0] : -1;
      where[1] = found[1], where[2] = found[2], where[3] = found[3];
    }
    __syncthreads();
    if (where[0] < 0) return;  // the whole block: past the last tile
    e = where[0], first = where[1], m_extent = where[2], m0 = where[3];
    k_extent = P == Product::forward ? ops.in : ops.out;
    n0 = static_cast<int64_t>(blockIdx.y) * kTileN;
  }

  const int tx = tid % (kTileN / kPerThread), ty = tid / (kTileN / kPerThread);
  float acc[kPerThread][kPerThread] = {};
  for (int64_t k0 = 0; k0 < k_extent; k0 += kTileK) {
    for (int i = tid; i < kTileK * kTileM; i += kThreads) {
      // Consecutive threads along the operand's contiguous dimension.
      const int kk = Operands<T, P>::kAAlongM ? i / kTileM : i % kTileK;
      const int mm = Operands<T, P>::kAAlongM ? i % kTileM : i / kTileK;
      const int64_t m = m0 + mm, k = k0 + kk;
      a_tile[kk][mm] = m < m_extent && k < k_extent ? ops.a(e, first, m, k) : 0.0f;
    }
    for (int i = tid; i < kTileK * kTileN; i += kThreads) {
      const int kk = Operands<T, P>::kBAlongN ? i / kTileN : i % kTileK;
      const int nn = Operands<T, P>::kBAlongN ? i % kTileN : i / kTileK;
      const int64_t n = n0 + nn, k = k0 + kk;
      b_tile[kk][nn] = n < n_total && k < k_extent ? ops.b(e, first, k, n) : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kTileK; ++kk) {
      float av[kPerThread], bv[kPerThread];
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) av[i] = a_tile[kk][ty + i * (kTileM / kPerThread)];
#pragma unroll
      for (int j = 0; j < kPerThread; ++j) bv[j] = b_tile[kk][tx + j * (kTileN / kPerThread)];
#pragma unroll
      for (int i = 0; i < kPerThread; ++i)
#pragma unroll
        for (int j = 0; j < kPerThread; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
    }
    __syncthreads();
  }

#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int64_t m = m0 + ty + i * (kTileM / kPerThread);
    if (m >= m_extent) continue;
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int64_t n = n0 + tx + j * (kTileN / kPerThread);
      if (n >= n_total) continue;
      if constexpr (P == Product::weight_grad) {
        c[(e * ops.out + m) * ops.in + n] += acc[i][j];
      } else {
        const int64_t row = first + m;
        from_f32(acc[i][j], &c[row * n_total + n]);
      }
    }
  }
}

template <typename T, Product P, typename TC>
void launch_portable(const ExecContext& ctx, const void* a, const void* b, const int32_t* offsets, int64_t experts, int64_t rows, int64_t in,
                     int64_t out, TC* c, const char* op) {
  KILN_CHECK(experts <= 65535, op, "{} experts", experts);
  const Operands<T, P> ops{static_cast<const T*>(a), static_cast<const T*>(b), in, out};
  const int64_t n_total = P == Product::forward ? out : in;
  dim3 grid;
  if constexpr (P == Product::weight_grad) {
    const int64_t tiles = ((out + kTileM - 1) / kTileM) * ((in + kTileN - 1) / kTileN);
    grid = dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(experts));
  } else {
    const int64_t n_tiles = (n_total + kTileN - 1) / kTileN;
    KILN_CHECK(n_tiles <= 65535, op, "{} columns", n_total);
    grid = dim3(static_cast<unsigned>(rows / kTileM + experts), static_cast<unsigned>(n_tiles));
  }
  grouped_gemm_kernel<T, TC, P><<<grid, kThreads, 0, stream(ctx)>>>(ops, offsets, experts, n_total, c);
  check_launch(op, "grouped_gemm_kernel");
}

std::atomic<bool> g_cutlass_enabled{true};

bool use_cutlass(DType dtype, int64_t in, int64_t out, std::initializer_list<const void*> bases) {
  return g_cutlass_enabled.load() && grouped_gemm_uses_cutlass(dtype, in, out, bases);
}

}  // namespace

bool grouped_gemm_uses_cutlass(DType dtype, int64_t in, int64_t out, std::initializer_list<const void*> bases) {
  if (dtype != DType::bf16 || in % 8 != 0 || out % 8 != 0 || !sm90::grouped_gemm_available()) return false;
  for (const void* p : bases)
    if (!vec::aligned16(p)) return false;
  return true;
}

void set_grouped_gemm_cutlass(bool enabled) { g_cutlass_enabled.store(enabled); }

void grouped_linear_forward(const ExecContext& ctx, const void* x, const void* w, DType dtype, const int32_t* offsets, int64_t experts,
                            int64_t rows, int64_t in, int64_t out, void* y) {
  constexpr const char* kOp = "moe_grouped_linear";
  if (rows == 0 || out == 0) return;
  if (use_cutlass(dtype, in, out, {x, w, y}))
    return sm90::grouped_forward(ctx, static_cast<const bf16_bits*>(x), static_cast<const bf16_bits*>(w), offsets, experts,
                                 in, out, static_cast<bf16_bits*>(y));
  if (dtype == DType::bf16)
    launch_portable<bf16, Product::forward>(ctx, x, w, offsets, experts, rows, in, out, static_cast<bf16*>(y), kOp);
  else
    launch_portable<float, Product::forward>(ctx, x, w, offsets, experts, rows, in, out, static_cast<float*>(y), kOp);
}

void grouped_linear_backward_input(const ExecContext& ctx, const void* dy, const void* w, DType dtype, const int32_t* offsets,
                                   int64_t experts, int64_t rows, int64_t in, int64_t out, void* dx) {
  constexpr const char* kOp = "moe_grouped_linear_backward";
  if (rows == 0 || in == 0) return;
  if (use_cutlass(dtype, in, out, {dy, w, dx}))
    return sm90::grouped_backward_input(ctx, static_cast<const bf16_bits*>(dy), static_cast<const bf16_bits*>(w), offsets,
                                        experts, in, out, static_cast<bf16_bits*>(dx));
  if (dtype == DType::bf16)
    launch_portable<bf16, Product::input_grad>(ctx, dy, w, offsets, experts, rows, in, out, static_cast<bf16*>(dx), kOp);
  else
    launch_portable<float, Product::input_grad>(ctx, dy, w, offsets, experts, rows, in, out, static_cast<float*>(dx), kOp);
}

void grouped_linear_backward_weight(const ExecContext& ctx, const void* x, const void* dy, DType dtype, const int32_t* offsets,
                                    int64_t experts, int64_t rows, int64_t in, int64_t out, float* dw) {
  constexpr const char* kOp = "moe_grouped_linear_backward";
  if (rows == 0 || in == 0 || out == 0) return;
  if (use_cutlass(dtype, in, out, {x, dy, dw}))
    return sm90::grouped_backward_weight(ctx, static_cast<const bf16_bits*>(x), static_cast<const bf16_bits*>(dy), offsets,
                                         experts, in, out, dw);
  if (dtype == DType::bf16)
    launch_portable<bf16, Product::weight_grad>(ctx, dy, x, offsets, experts, rows, in, out, dw, kOp);
  else
    launch_portable<float, Product::weight_grad>(ctx, dy, x, offsets, experts, rows, in, out, dw, kOp);
}

}  // namespace kiln::cuda

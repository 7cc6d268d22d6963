// Elementwise bf16 kernels of the mixed-precision path (declared in the op folders' *_cuda.h):
// dtype casts, the fp32 + bf16 residual add, RoPE, the q|k|v shuffle and SwiGLU.
//
// Each kernel has two shapes, chosen per call: W = 8 elements per thread (16-byte bf16
// loads and stores, two float4 for fp32) when the inner dimension is a multiple of 8 and
// every pointer is 16-byte aligned, else W = 1 (plain scalar code for awkward sizes and
// offset views). Math is fp32 and follows the fp32 kernels of elementwise_cuda.cu
// formula for formula, so the two paths differ only by the bf16 roundings at the edges.
#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "ops/elementwise/elementwise_cuda.h"
#include "ops/rope/rope_cuda.h"
#include "ops/split/qkv_split_cuda.h"
#include "ops/swiglu/swiglu_cuda.h"

#include "ops/bf16_vector.cuh"
#include "ops/grid_stride.cuh"

#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

namespace kiln::cuda {

namespace {

using bf16 = __nv_bfloat16;

constexpr int kThreads = 256;
constexpr int kVec = vec::kWidth;

using vec::aligned16;

const bf16* as_bf16(const bf16_bits* p) { return reinterpret_cast<const bf16*>(p); }
bf16* as_bf16(bf16_bits* p) { return reinterpret_cast<bf16*>(p); }

using vec::load;
using vec::store;

// ---- kernels ------------------------------------------------------------------------------

// dst = src converted (fp32 -> bf16 rounds to nearest even; bf16 -> fp32 is exact). The
// first n / W * W elements go in vectors, the rest (fewer than 8) one per thread.
template <typename From, typename To, int W>
__global__ void convert_kernel(const From* __restrict__ src, int64_t n, To* __restrict__ dst) {
  const int64_t body = n / W * W;
  KILN_GRID_STRIDE(i, body / W) {
    float v[W];
    load<W>(src + i * W, v);
    store<W>(dst + i * W, v);
  }
  KILN_GRID_STRIDE(i, n - body) {
    float v[1];
    load<1>(src + body + i, v);
    store<1>(dst + body + i, v);
  }
}

// out = a + b; out may alias a (each thread reads its elements before it writes them).
template <int W>
__global__ void add_f32_bf16_kernel(const float* a, const bf16* __restrict__ b, int64_t n, float* out) {
  const int64_t body = n / W * W;
  KILN_GRID_STRIDE(i, body / W) {
    float x[W], y[W];
    load<W>(a + i * W, x);
    load<W>(b + i * W, y);
#pragma unroll
    for (int k = 0; k < W; ++k) x[k] += y[k];
    store<W>(out + i * W, x);
  }
  KILN_GRID_STRIDE(i, n - body) out[body + i] = a[body + i] + __bfloat162float(b[body + i]);
}

// x [n, heads, 2 * half] rotated in place by rotate_half: pairs (j, j + half). W
// consecutive j per thread; W divides half.
template <int W>
__global__ void rope_kernel(bf16* __restrict__ x, const int32_t* __restrict__ pos, const float* __restrict__ cos,
                            const float* __restrict__ sin, int64_t n, int64_t heads, int64_t half, float sign) {
  const int64_t groups = half / W;
  KILN_GRID_STRIDE(idx, n * heads * groups) {
    const int64_t j = idx % groups * W, row = idx / groups, i = row / heads;
    bf16* v = x + row * 2 * half;
    const int64_t table = static_cast<int64_t>(pos[i]) * half + j;
    float x1[W], x2[W], c[W], s[W];
    load<W>(v + j, x1);
    load<W>(v + j + half, x2);
    load<W>(cos + table, c);
    load<W>(sin + table, s);
    float o1[W], o2[W];
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const float sk = sign * s[k];
      o1[k] = x1[k] * c[k] - x2[k] * sk;
      o2[k] = x2[k] * c[k] + x1[k] * sk;
    }
    store<W>(v + j, o1);
    store<W>(v + j + half, o2);
  }
}

// fused [n, q_cols + 2 * kv_cols] <-> q [n, q_cols], k, v [n, kv_cols]: a bit-exact copy,
// W elements at a time (W divides q_cols and kv_cols, so no vector straddles two parts).
template <int W>
__global__ void qkv_shuffle_kernel(uint16_t* fused, uint16_t* q, uint16_t* k, uint16_t* v, int64_t n, int64_t q_cols,
                                   int64_t kv_cols, bool to_parts) {
  using Chunk = std::conditional_t<W == 1, uint16_t, uint4>;
  static_assert(sizeof(Chunk) == W * sizeof(uint16_t));
  const int64_t cols = q_cols + 2 * kv_cols, chunks = cols / W;
  KILN_GRID_STRIDE(idx, n * chunks) {
    const int64_t i = idx / chunks, c = idx % chunks * W;
    uint16_t* part = c < q_cols ? q + i * q_cols + c
                     : c < q_cols + kv_cols ? k + i * kv_cols + (c - q_cols)
                                            : v + i * kv_cols + (c - q_cols - kv_cols);
    Chunk* fused_chunk = reinterpret_cast<Chunk*>(fused + i * cols + c);
    Chunk* part_chunk = reinterpret_cast<Chunk*>(part);
    if (to_parts)
      *part_chunk = *fused_chunk;
    else
      *fused_chunk = *part_chunk;
  }
}

// gate_up [n, 2f] (gate | up) -> out [n, f] = silu(gate) * up.
template <int W>
__global__ void swiglu_forward_kernel(const bf16* __restrict__ gu, int64_t n, int64_t f, bf16* __restrict__ out) {
  const int64_t groups = f / W;
  KILN_GRID_STRIDE(idx, n * groups) {
    const int64_t i = idx / groups, j = idx % groups * W;
    float g[W], u[W], o[W];
    load<W>(gu + i * 2 * f + j, g);
    load<W>(gu + i * 2 * f + f + j, u);
#pragma unroll
    for (int k = 0; k < W; ++k) o[k] = g[k] / (1.0f + expf(-g[k])) * u[k];
    store<W>(out + i * f + j, o);
  }
}

// out (optional; may alias dout, so neither is __restrict__): the forward's output again,
// computed as swiglu_forward_kernel does.
template <int W>
__global__ void swiglu_backward_kernel(const bf16* __restrict__ gu, const bf16* dout, int64_t n, int64_t f,
                                       bf16* __restrict__ dgu, bf16* out) {
  const int64_t groups = f / W;
  KILN_GRID_STRIDE(idx, n * groups) {
    const int64_t i = idx / groups, j = idx % groups * W;
    float g[W], u[W], dy[W], dg[W], du[W], o[W];
    load<W>(gu + i * 2 * f + j, g);
    load<W>(gu + i * 2 * f + f + j, u);
    load<W>(dout + i * f + j, dy);
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const float s = 1.0f / (1.0f + expf(-g[k]));
      dg[k] = dy[k] * u[k] * s * (1.0f + g[k] * (1.0f - s));
      du[k] = dy[k] * g[k] * s;
      o[k] = g[k] / (1.0f + expf(-g[k])) * u[k];
    }
    store<W>(dgu + i * 2 * f + j, dg);
    store<W>(dgu + i * 2 * f + f + j, du);
    if (out) store<W>(out + i * f + j, o);
  }
}

// Launches kernel<8> over items / 8 work items when vec, else kernel<1> over items.
#define KILN_LAUNCH_W(op, kernel, vec, items, ...)                                                      \
  do {                                                                                                 \
    if (vec) kernel<kVec><<<blocks_for((items) / kVec, kThreads), kThreads, 0, stream()>>>(__VA_ARGS__); \
    else kernel<1><<<blocks_for((items), kThreads), kThreads, 0, stream()>>>(__VA_ARGS__);               \
    check_launch(op, #kernel);                                                                         \
  } while (0)

template <typename From, typename To>
void convert(const From* src, int64_t n, To* dst, const char* op) {
  if (n == 0) return;
  // The vector kernel's grid covers the n / 8 vectors; its tail of < 8 elements needs one block.
  if (aligned16(src) && aligned16(dst))
    convert_kernel<From, To, kVec><<<blocks_for(n / kVec, kThreads), kThreads, 0, stream()>>>(src, n, dst);
  else
    convert_kernel<From, To, 1><<<blocks_for(n, kThreads), kThreads, 0, stream()>>>(src, n, dst);
  check_launch(op, "convert_kernel");
}

}  // namespace

void cast_f32_to_bf16(const float* src, int64_t n, bf16_bits* dst) {
  convert(src, n, as_bf16(dst), "cast_f32_to_bf16");
}

void cast_bf16_to_f32(const bf16_bits* src, int64_t n, float* dst) {
  convert(as_bf16(src), n, dst, "cast_bf16_to_f32");
}

void add_f32_bf16(const float* a, const bf16_bits* b, int64_t n, float* out) {
  if (n == 0) return;
  const bool vec = aligned16(a) && aligned16(b) && aligned16(out);
  KILN_LAUNCH_W("add_f32_bf16", add_f32_bf16_kernel, vec, n, a, as_bf16(b), n, out);
}

void rope_apply_bf16(bf16_bits* x, const int32_t* positions, const float* cos, const float* sin, int64_t n,
                     int64_t heads, int64_t half, bool inverse) {
  if (n * heads * half == 0) return;
  const bool vec = half % kVec == 0 && aligned16(x) && aligned16(cos) && aligned16(sin);
  KILN_LAUNCH_W("rope_bf16", rope_kernel, vec, n * heads * half, as_bf16(x), positions, cos, sin, n, heads, half,
                inverse ? -1.0f : 1.0f);
}

void qkv_shuffle_bf16(bf16_bits* fused, bf16_bits* q, bf16_bits* k, bf16_bits* v, int64_t n, int64_t q_cols,
                      int64_t kv_cols, bool to_parts) {
  const int64_t items = n * (q_cols + 2 * kv_cols);
  if (items == 0) return;
  const bool vec = q_cols % kVec == 0 && kv_cols % kVec == 0 && aligned16(fused) && aligned16(q) && aligned16(k) &&
                   aligned16(v);
  KILN_LAUNCH_W("qkv_split_bf16", qkv_shuffle_kernel, vec, items, fused, q, k, v, n, q_cols, kv_cols, to_parts);
}

void swiglu_forward_bf16(const bf16_bits* gate_up, int64_t n, int64_t f, bf16_bits* out) {
  if (n * f == 0) return;
  const bool vec = f % kVec == 0 && aligned16(gate_up) && aligned16(out);
  KILN_LAUNCH_W("swiglu_bf16", swiglu_forward_kernel, vec, n * f, as_bf16(gate_up), n, f, as_bf16(out));
}

void swiglu_backward_bf16(const bf16_bits* gate_up, const bf16_bits* dout, int64_t n, int64_t f,
                          bf16_bits* dgate_up, bf16_bits* out) {
  if (n * f == 0) return;
  const bool vec = f % kVec == 0 && aligned16(gate_up) && aligned16(dout) && aligned16(dgate_up) && aligned16(out);
  KILN_LAUNCH_W("swiglu_backward_bf16", swiglu_backward_kernel, vec, n * f, as_bf16(gate_up), as_bf16(dout), n, f,
                as_bf16(dgate_up), out ? as_bf16(out) : nullptr);
}

}  // namespace kiln::cuda

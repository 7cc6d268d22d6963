// The delta rule's step as one GPU block runs it, shared by the sequence kernels
// (kda_cuda.cu) and the decode kernel (kda_decode_cuda.cu), so a decoded token gets the
// same fp32 operations, in the same order, as the same token in a full forward.
//
// A block of 128 threads (4 warps) owns one head's state slice: a lane holds R =
// ceil(d_k / 32) rows (i = lane + 32 r), a warp C = 16 / R columns, so each thread keeps 16
// fp32 values in registers and a block BV = 4 C columns of d_v. Reductions over rows are
// xor butterflies (every lane the same bits). Include from .cu files only.
#pragma once

#include "core/error.h"
#include "ops/bf16_vector.cuh"
#include "ops/kda/kda_cuda.h"

#include <cuda_bf16.h>

#include <cstdint>

namespace kiln::cuda::kda_step {

using bf16 = __nv_bfloat16;
using vec::from_f32;
using vec::to_f32;

constexpr int kThreads = 128;  // 4 warps
constexpr int kWarps = kThreads / 32;
constexpr int kRegs = 16;      // state values per thread: R rows x C columns
constexpr int kMaxDk = 256;

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
  return x;
}

inline int rows_per_lane(int64_t dk) { return dk <= 32 ? 1 : dk <= 64 ? 2 : dk <= 128 ? 4 : 8; }
inline int64_t slice_columns(int64_t dk) { return int64_t{kWarps} * (kRegs / rows_per_lane(dk)); }
inline int64_t slices(int64_t dk, int64_t dv) { return (dv + slice_columns(dk) - 1) / slice_columns(dk); }

// One token's inputs for this thread's rows and columns, as fp32.
template <typename T, int R, int C>
struct Token {
  float k[R], a[R], q[R], v[C], beta;

  __device__ __forceinline__ void load(const KdaArgs& s, const T* q_, const T* k_, const T* v_, const T* g_,
                                       const T* beta_, int64_t row, int lane, int64_t j0) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int64_t i = lane + 32 * r;
      const bool ok = i < s.dk;
      k[r] = ok ? to_f32(k_[row * s.dk + i]) : 0.f;
      q[r] = ok ? to_f32(q_[row * s.dk + i]) : 0.f;
      a[r] = ok ? expf(to_f32(g_[row * s.dk + i])) : 1.f;
    }
#pragma unroll
    for (int c = 0; c < C; ++c) v[c] = j0 + c < s.dv ? to_f32(v_[row * s.dv + j0 + c]) : 0.f;
    beta = to_f32(beta_[row]);
  }
};

// A state slice [R][C] to or from fp32 global memory [.., d_k, d_v] at `base`.
template <int R, int C>
__device__ __forceinline__ void load_state(const KdaArgs& s, const float* base, int lane, int64_t j0,
                                           float (&S)[R][C]) {
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int64_t i = lane + 32 * r, j = j0 + c;
      S[r][c] = base && i < s.dk && j < s.dv ? base[i * s.dv + j] : 0.f;
    }
}

template <int R, int C>
__device__ __forceinline__ void store_state(const KdaArgs& s, float* base, int lane, int64_t j0,
                                            const float (&S)[R][C]) {
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int64_t i = lane + 32 * r, j = j0 + c;
      if (i < s.dk && j < s.dv) base[i * s.dv + j] = S[r][c];
    }
}

// One step of the recurrence in place: S = Diag(a) S; w = v - S^T k; S += k (beta w)^T.
// Returns nothing; w is left in `w`.
template <typename T, int R, int C>
__device__ __forceinline__ void step(const Token<T, R, C>& x, float (&S)[R][C], float (&w)[C]) {
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int c = 0; c < C; ++c) S[r][c] *= x.a[r];
#pragma unroll
  for (int c = 0; c < C; ++c) {
    float p = 0.f;
#pragma unroll
    for (int r = 0; r < R; ++r) p += x.k[r] * S[r][c];
    w[c] = x.v[c] - warp_sum(p);
  }
#pragma unroll
  for (int c = 0; c < C; ++c) {
    const float d = x.beta * w[c];
#pragma unroll
    for (int r = 0; r < R; ++r) S[r][c] += x.k[r] * d;
  }
}

// o = scale S^T q for this thread's columns, written to out_row [d_v] by the lane whose
// index is the column's within the warp.
template <typename T, int R, int C>
__device__ __forceinline__ void read_out(const KdaArgs& s, const Token<T, R, C>& x, const float (&S)[R][C], int lane,
                                         int64_t j0, T* out_row) {
#pragma unroll
  for (int c = 0; c < C; ++c) {
    float p = 0.f;
#pragma unroll
    for (int r = 0; r < R; ++r) p += x.q[r] * S[r][c];
    const float o = s.scale * warp_sum(p);
    if (lane == c && j0 + c < s.dv) from_f32(o, out_row + j0 + c);
  }
}

// Calls f.template operator()<T, R>() for the dtype and d_k.
template <typename F>
void dispatch(const char* op, DType dtype, int64_t dk, F&& f) {
  KILN_CHECK(dk >= 1 && dk <= kMaxDk, op, "d_k must be in [1, {}] on the GPU, got {}", kMaxDk, dk);
  KILN_CHECK(dtype == DType::f32 || dtype == DType::bf16, op, "f32 or bf16 only on the GPU");
  auto by_rows = [&](auto zero) {
    using T = decltype(zero);
    switch (rows_per_lane(dk)) {
      case 1: f.template operator()<T, 1>(); break;
      case 2: f.template operator()<T, 2>(); break;
      case 4: f.template operator()<T, 4>(); break;
      default: f.template operator()<T, 8>(); break;
    }
  };
  if (dtype == DType::f32)
    by_rows(float{});
  else
    by_rows(bf16{});
}

}  // namespace kiln::cuda::kda_step

// Attention input preparation (ops/attention/qkv_prepare.h) on the GPU, fp32 or bf16 data
// with fp32 gains and tables; arithmetic in fp32.
//
// One row = one head of one token, D = 2 * half values; the fused projection's row of a
// token holds its q heads, then k heads, then v heads, each D wide, so row r of the
// [tokens * heads_all, D] view is at qkv + r * D. A group of G threads (a power of two,
// G <= 32, so sums reduce by shuffles) takes a row; thread t owns the vectors i = t, t + G,
// ... of W values in each half, which keeps RoPE's pairs (j, j + half) in one thread.
// Every group runs the same shuffles whatever its row's kind (q, k or v) or validity.
//
// The backward's gain gradients (sum over rows of d * x * rstd, per column) follow
// rms_norm_bf16.cu: each block owns a contiguous range of rows, each group keeps its own
// column sums in shared memory, the block folds its groups in order into one row of
// partials in the context's device scratch, and a second kernel adds the partial rows in
// order. The block count depends only on the shape, so the gradients are bitwise
// reproducible; no allocation after the first call and no host synchronization (CUDA-graph
// safe); each stream has its own scratch.
#include "core/context_scratch.h"
#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "ops/bf16_vector.cuh"
#include "ops/block_reduce.cuh"
#include "ops/column_sums.cuh"
#include "ops/attention/qkv_prepare_cuda.h"

#include <algorithm>
#include <climits>
#include <type_traits>

namespace kiln::cuda {

namespace {

using bf16 = __nv_bfloat16;
using vec::load;
using vec::store;

constexpr const char* kOp = "qkv_prepare";
constexpr int kBlockThreads = 256;
constexpr int64_t kMaxHeadDim = 512;
// Gain partials: one row of 2 * head_dim floats per block, whose groups take the block's
// rows one at a time. 2048 blocks fill the GPU several times over (4096 measured slower).
constexpr int64_t kGainBlocks = 2048;
constexpr int64_t kGainScratchFloats = kGainBlocks * 2 * kMaxHeadDim;  // 8 MiB
// [block][q gain cols | k gain cols], in the context's scratch (core/context_scratch.h).
constexpr ScratchKind kGainPartials{"qkv_prepare_backward", kGainScratchFloats * sizeof(float)};

struct Geometry {
  int64_t tokens;
  int64_t q_heads, kv_heads, half;
  const float* q_gain;  // null: no norm
  const float* k_gain;
  float eps;
  const int32_t* positions;
  const float* cos;  // null: no rotation
  const float* sin;
};

// Where row r's head lives in the q/k/v tensors and what is done to it.
struct Head {
  int64_t token;
  int64_t part_row;     // row in q [tokens * Hq, D] or k / v [tokens * Hkv, D]
  int kind;             // 0 = q, 1 = k, 2 = v
  const float* gain;    // q or k gain, null for v or without norm
  bool rotate;
};

__device__ __forceinline__ Head head_of(const Geometry& g, int64_t r) {
  const int64_t heads_all = g.q_heads + 2 * g.kv_heads;
  Head h;
  h.token = r / heads_all;
  const int64_t j = r % heads_all;
  if (j < g.q_heads) {
    h.kind = 0, h.part_row = h.token * g.q_heads + j, h.gain = g.q_gain;
  } else if (j < g.q_heads + g.kv_heads) {
    h.kind = 1, h.part_row = h.token * g.kv_heads + (j - g.q_heads), h.gain = g.k_gain;
  } else {
    h.kind = 2, h.part_row = h.token * g.kv_heads + (j - g.q_heads - g.kv_heads), h.gain = nullptr;
  }
  h.rotate = h.kind != 2 && g.cos != nullptr;
  return h;
}

template <typename T, int G, int W>
__global__ void __launch_bounds__(kBlockThreads)
    forward_kernel(Geometry g, const T* __restrict__ qkv, T* __restrict__ q, T* __restrict__ k, T* __restrict__ v) {
  constexpr int kRows = kBlockThreads / G;
  const int t = static_cast<int>(threadIdx.x % G);
  const int64_t rows = g.tokens * (g.q_heads + 2 * g.kv_heads), d = 2 * g.half;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRows + threadIdx.x / G;
  const bool valid = row < rows;
  const Head h = head_of(g, valid ? row : 0);
  const T* x = qkv + (valid ? row : 0) * d;
  T* out = (h.kind == 0 ? q : h.kind == 1 ? k : v) + h.part_row * d;
  const int64_t vecs = valid ? g.half / W : 0;

  float sum_sq = 0.0f;
  if (h.gain)
    for (int64_t i = t; i < vecs; i += G) {
      float a[W], b[W];
      load<W>(x + i * W, a);
      load<W>(x + g.half + i * W, b);
#pragma unroll
      for (int e = 0; e < W; ++e) sum_sq += a[e] * a[e] + b[e] * b[e];
    }
  sum_sq = group_sum<G>(sum_sq);
  const float inv = h.gain ? 1.0f / sqrtf(sum_sq / static_cast<float>(d) + g.eps) : 1.0f;
  const int64_t table_row = h.rotate ? static_cast<int64_t>(g.positions[h.token]) * g.half : 0;

  for (int64_t i = t; i < vecs; i += G) {
    float a[W], b[W];
    load<W>(x + i * W, a);
    load<W>(x + g.half + i * W, b);
    if (h.gain) {
      float wa[W], wb[W];
      load<W>(h.gain + i * W, wa);
      load<W>(h.gain + g.half + i * W, wb);
#pragma unroll
      for (int e = 0; e < W; ++e) a[e] = a[e] * inv * wa[e], b[e] = b[e] * inv * wb[e];
    }
    if (h.rotate) {
      float c[W], s[W];
      load<W>(g.cos + table_row + i * W, c);
      load<W>(g.sin + table_row + i * W, s);
#pragma unroll
      for (int e = 0; e < W; ++e) {
        const float a0 = a[e], b0 = b[e];
        a[e] = a0 * c[e] - b0 * s[e];
        b[e] = b0 * c[e] + a0 * s[e];
      }
    }
    store<W>(out + i * W, a);
    store<W>(out + g.half + i * W, b);
  }
}

// Shared-memory slot of column (part p of the row, vector i, element e) in a group's sums:
// for each e a warp touches consecutive words.
template <int W>
__device__ __forceinline__ int64_t slot(int64_t half, int p, int64_t i, int e) {
  return p * half + e * (half / W) + i;
}

// At most 64 registers (4 blocks per SM): uncapped, the compiler took 96 and fit only two,
// too few loads in flight for a kernel that streams four arrays.
template <typename T, int G, int W>
__global__ void __launch_bounds__(kBlockThreads, 4)
    backward_kernel(Geometry g, const T* __restrict__ qkv, const T* __restrict__ dq, const T* __restrict__ dk,
                    const T* __restrict__ dv, int64_t rows_per_block, T* __restrict__ dqkv, bool with_gain_grad,
                    float* __restrict__ gain_partials) {
  constexpr int kRows = kBlockThreads / G;
  extern __shared__ float gain_sums[];  // kRows groups x [q gain cols | k gain cols]
  const int t = static_cast<int>(threadIdx.x % G);
  const int group = static_cast<int>(threadIdx.x / G);
  const int64_t rows = g.tokens * (g.q_heads + 2 * g.kv_heads), d = 2 * g.half;
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * rows_per_block;
  const int64_t end = begin + rows_per_block < rows ? begin + rows_per_block : rows;
  const int64_t iterations = (end - begin + kRows - 1) / kRows;
  float* my_sums = gain_sums + group * 2 * d;
  if (with_gain_grad)
    for (int64_t c = t; c < 2 * d; c += G) my_sums[c] = 0.0f;

  for (int64_t it = 0; it < iterations; ++it) {
    const int64_t row = begin + it * kRows + group;
    const bool valid = row < end;
    const Head h = head_of(g, valid ? row : 0);
    const T* x = qkv + (valid ? row : 0) * d;
    const T* dy = (h.kind == 0 ? dq : h.kind == 1 ? dk : dv) + h.part_row * d;
    T* dx = dqkv + (valid ? row : 0) * d;
    const int64_t vecs = valid ? g.half / W : 0;
    const int64_t table_row = h.rotate ? static_cast<int64_t>(g.positions[h.token]) * g.half : 0;

    // The gradient at the norm's output: dy rotated back (the transposed rotation).
    auto unrotate = [&](int64_t i, float (&a)[W], float (&b)[W]) {
      load<W>(dy + i * W, a);
      load<W>(dy + g.half + i * W, b);
      if (!h.rotate) return;
      float c[W], s[W];
      load<W>(g.cos + table_row + i * W, c);
      load<W>(g.sin + table_row + i * W, s);
#pragma unroll
      for (int e = 0; e < W; ++e) {
        const float a0 = a[e], b0 = b[e];
        a[e] = a0 * c[e] + b0 * s[e];
        b[e] = b0 * c[e] - a0 * s[e];
      }
    };

    float sum_sq = 0.0f, dot = 0.0f;
    if (h.gain)
      for (int64_t i = t; i < vecs; i += G) {
        float xa[W], xb[W], ga[W], gb[W], wa[W], wb[W];
        load<W>(x + i * W, xa);
        load<W>(x + g.half + i * W, xb);
        unrotate(i, ga, gb);
        load<W>(h.gain + i * W, wa);
        load<W>(h.gain + g.half + i * W, wb);
#pragma unroll
        for (int e = 0; e < W; ++e) {
          sum_sq += xa[e] * xa[e] + xb[e] * xb[e];
          dot += ga[e] * wa[e] * xa[e] + gb[e] * wb[e] * xb[e];
        }
      }
    sum_sq = group_sum<G>(sum_sq);
    dot = group_sum<G>(dot);
    if (!valid) continue;
    const float inv = h.gain ? 1.0f / sqrtf(sum_sq / static_cast<float>(d) + g.eps) : 1.0f;
    const float coef = dot * inv * inv / static_cast<float>(d);
    const bool accumulate = with_gain_grad && h.gain != nullptr;
    float* sums = my_sums + (h.kind == 1 ? d : 0);

    for (int64_t i = t; i < vecs; i += G) {
      float ga[W], gb[W];
      unrotate(i, ga, gb);
      if (h.gain) {
        float xa[W], xb[W], wa[W], wb[W];
        load<W>(x + i * W, xa);
        load<W>(x + g.half + i * W, xb);
        load<W>(h.gain + i * W, wa);
        load<W>(h.gain + g.half + i * W, wb);
#pragma unroll
        for (int e = 0; e < W; ++e) {
          if (accumulate) {
            sums[slot<W>(g.half, 0, i, e)] += ga[e] * xa[e] * inv;
            sums[slot<W>(g.half, 1, i, e)] += gb[e] * xb[e] * inv;
          }
          ga[e] = inv * (ga[e] * wa[e] - xa[e] * coef);
          gb[e] = inv * (gb[e] * wb[e] - xb[e] * coef);
        }
      }
      store<W>(dx + i * W, ga);
      store<W>(dx + g.half + i * W, gb);
    }
  }
  if (!with_gain_grad) return;

  __syncthreads();  // every group's sums are complete
  float* partial = gain_partials + static_cast<int64_t>(blockIdx.x) * 2 * d;
  for (int64_t c = threadIdx.x; c < 2 * d; c += kBlockThreads) {
    const int64_t kind_offset = c / d * d, col = c % d;
    const int p = static_cast<int>(col / g.half);
    const int64_t in_half = col % g.half;
    const int64_t s = kind_offset + slot<W>(g.half, p, in_half / W, static_cast<int>(in_half % W));
    float total = 0.0f;
    for (int gi = 0; gi < kRows; ++gi) total += gain_sums[gi * 2 * d + s];
    partial[c] = total;
  }
}

// q_gain[c] += sum over blocks of partial[b][c], in a fixed order (ops/column_sums.cuh);
// k_gain from the second half.
constexpr int kSumSlices = 32;

__global__ void __launch_bounds__(kColumnSumCols* kSumSlices)
    gain_sum_kernel(const float* __restrict__ gain_partials, int64_t blocks, int64_t d, float* __restrict__ q_gain_grad,
                    float* __restrict__ k_gain_grad) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kColumnSumCols + threadIdx.x;
  float total;
  if (!column_total<kSumSlices>(gain_partials, blocks, 2 * d, c, total)) return;
  if (c < d) q_gain_grad[c] += total;
  else k_gain_grad[c - d] += total;
}

unsigned grid_size(int64_t blocks) {
  KILN_CHECK(blocks <= INT_MAX, kOp, "{} blocks exceed the grid limit", blocks);
  return static_cast<unsigned>(blocks);
}

bool aligned16(const void* p) { return p == nullptr || vec::aligned16(p); }

Geometry geometry_of(const QkvPrepareArgs& a) {
  KILN_CHECK(a.head_dim % 2 == 0 && a.head_dim <= kMaxHeadDim, kOp, "head_dim {} must be even and at most {}",
             a.head_dim, kMaxHeadDim);
  return Geometry{a.tokens, a.q_heads, a.kv_heads, a.head_dim / 2, a.q_gain, a.k_gain,
                  a.eps,    a.positions, a.cos,   a.sin};
}

// Calls f(T{}, integral_constant<G>, integral_constant<W>): the storage type, the threads
// per row (enough for the vectors of one half, at least 4, at most a warp) and the width.
template <typename F>
void dispatch(bool bf16_data, int64_t half, bool vector, F&& f) {
  auto with_width = [&](auto tz, auto width) {
    const int64_t slots = half / decltype(width)::value;
    if (slots <= 4) f(tz, std::integral_constant<int, 4>{}, width);
    else if (slots <= 8) f(tz, std::integral_constant<int, 8>{}, width);
    else if (slots <= 16) f(tz, std::integral_constant<int, 16>{}, width);
    else f(tz, std::integral_constant<int, 32>{}, width);
  };
  auto with_type = [&](auto tz) {
    if (vector) with_width(tz, std::integral_constant<int, vec::kWidth>{});
    else with_width(tz, std::integral_constant<int, 1>{});
  };
  if (bf16_data) with_type(bf16{});
  else with_type(float{});
}

bool vector_path(const Geometry& g, std::initializer_list<const void*> pointers) {
  if (g.half % vec::kWidth != 0) return false;
  for (const void* p : pointers)
    if (!aligned16(p)) return false;
  return aligned16(g.q_gain) && aligned16(g.k_gain) && aligned16(g.cos) && aligned16(g.sin);
}

}  // namespace

void qkv_prepare_forward(const ExecContext& ctx, const QkvPrepareArgs& a, const void* qkv, void* q, void* k, void* v) {
  const Geometry g = geometry_of(a);
  const int64_t rows = g.tokens * (g.q_heads + 2 * g.kv_heads);
  if (rows == 0 || g.half == 0) return;
  dispatch(a.bf16, g.half, vector_path(g, {qkv, q, k, v}), [&](auto tz, auto threads, auto width) {
    using T = decltype(tz);
    constexpr int G = decltype(threads)::value, W = decltype(width)::value;
    constexpr int64_t kRows = kBlockThreads / G;
    forward_kernel<T, G, W><<<grid_size((rows + kRows - 1) / kRows), kBlockThreads, 0, stream(ctx)>>>(
        g, static_cast<const T*>(qkv), static_cast<T*>(q), static_cast<T*>(k), static_cast<T*>(v));
    check_launch(kOp, "forward_kernel");
  });
}

void qkv_prepare_backward(const ExecContext& ctx, const QkvPrepareArgs& a, const void* qkv, const void* dq, const void* dk, const void* dv,
                          void* dqkv, float* q_gain_grad, float* k_gain_grad) {
  const Geometry g = geometry_of(a);
  const int64_t rows = g.tokens * (g.q_heads + 2 * g.kv_heads), d = 2 * g.half;
  if (rows == 0 || g.half == 0) return;
  const bool with_gain_grad = q_gain_grad != nullptr && a.q_gain != nullptr;
  float* const gain_partials = with_gain_grad ? context_scratch_as<float>(ctx, kGainPartials) : nullptr;
  dispatch(a.bf16, g.half, vector_path(g, {qkv, dq, dk, dv, dqkv}), [&](auto tz, auto threads, auto width) {
    using T = decltype(tz);
    constexpr int G = decltype(threads)::value, W = decltype(width)::value;
    constexpr int64_t kRows = kBlockThreads / G;
    const int64_t groups = (rows + kRows - 1) / kRows;
    int64_t blocks = std::min({groups, kGainBlocks, kGainScratchFloats / (2 * d)});
    const int64_t rows_per_block = (rows + blocks - 1) / blocks;
    blocks = (rows + rows_per_block - 1) / rows_per_block;
    const size_t shared = with_gain_grad ? static_cast<size_t>(kRows * 2 * d) * sizeof(float) : 0;
    // At most 48 KiB (the default limit): kRows * 2 * d floats with d <= 512 and G >= 4.
    KILN_CHECK(shared <= 48 * 1024, kOp, "head_dim {} needs {} bytes of shared memory", d, shared);
    backward_kernel<T, G, W><<<grid_size(blocks), kBlockThreads, shared, stream(ctx)>>>(
        g, static_cast<const T*>(qkv), static_cast<const T*>(dq), static_cast<const T*>(dk),
        static_cast<const T*>(dv), rows_per_block, static_cast<T*>(dqkv), with_gain_grad, gain_partials);
    check_launch(kOp, "backward_kernel");
    if (with_gain_grad) {
      gain_sum_kernel<<<grid_size((2 * d + kColumnSumCols - 1) / kColumnSumCols), dim3(kColumnSumCols, kSumSlices), 0,
                        stream(ctx)>>>(
          gain_partials, blocks, d, q_gain_grad, k_gain_grad);
      check_launch(kOp, "gain_sum_kernel");
    }
  });
}

}  // namespace kiln::cuda

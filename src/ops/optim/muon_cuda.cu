// Muon on the GPU (declared in muon_cuda.h; the steps are described there). The elementwise
// kernels are one block per chunk of kMuonChunk elements of one matrix; each thread takes
// groups of 4 consecutive elements at 4 * kThreads apart, as float4 where the arrays are
// 16-byte aligned and one by one otherwise, in the same order either way, so its partial
// sum of squares (and hence every bit of the result) does not depend on the alignment.
// Every multiply and add of the momentum is an explicit intrinsic (no contraction): the
// bits of the f32 CPU reference, which is compiled with -ffp-contract=off.
#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "ops/block_reduce.cuh"
#include "ops/linear/linear_cuda.h"
#include "ops/optim/muon.h"
#include "ops/optim/muon_cuda.h"
#include "ops/optim/stochastic_round.h"

#include <cuda_bf16.h>

#include <cstdint>

namespace kiln::cuda {

namespace {

using bf16 = __nv_bfloat16;

constexpr int kThreads = 256;
constexpr int kGroup = 4;  // consecutive elements per thread and iteration

__device__ __forceinline__ bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Elements [i, i + 4) of p (those below end; the rest read as 0), vectorized when `vec`.
__device__ __forceinline__ void load4(const float* p, int64_t i, int64_t end, bool vec, float (&v)[kGroup]) {
  if (vec && i + kGroup <= end) {
    const float4 q = *reinterpret_cast<const float4*>(p + i);
    v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
  } else {
#pragma unroll
    for (int j = 0; j < kGroup; ++j) v[j] = i + j < end ? p[i + j] : 0.0f;
  }
}
__device__ __forceinline__ void store4(float* p, int64_t i, int64_t end, bool vec, const float (&v)[kGroup]) {
  if (vec && i + kGroup <= end) {
    *reinterpret_cast<float4*>(p + i) = make_float4(v[0], v[1], v[2], v[3]);
  } else {
#pragma unroll
    for (int j = 0; j < kGroup; ++j)
      if (i + j < end) p[i + j] = v[j];
  }
}
// bf16 slots start 256-byte aligned and i is a multiple of 4: 8-byte accesses always fit.
__device__ __forceinline__ void store4_bf16(bf16* p, int64_t i, int64_t end, const float (&v)[kGroup]) {
  if (i + kGroup <= end) {
    uint2 raw;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&raw);
    h[0] = __floats2bfloat162_rn(v[0], v[1]);
    h[1] = __floats2bfloat162_rn(v[2], v[3]);
    *reinterpret_cast<uint2*>(p + i) = raw;
  } else {
#pragma unroll
    for (int j = 0; j < kGroup; ++j)
      if (i + j < end) p[i + j] = __float2bfloat16_rn(v[j]);
  }
}
__device__ __forceinline__ void load4_bf16(const bf16* p, int64_t i, int64_t end, float (&v)[kGroup]) {
  if (i + kGroup <= end) {
    const uint2 raw = *reinterpret_cast<const uint2*>(p + i);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
    const float2 a = __bfloat1622float2(h[0]), b = __bfloat1622float2(h[1]);
    v[0] = a.x, v[1] = a.y, v[2] = b.x, v[3] = b.y;
  } else {
#pragma unroll
    for (int j = 0; j < kGroup; ++j) v[j] = i + j < end ? __bfloat162float(p[i + j]) : 0.0f;
  }
}

// M = mu M + g, or mu M + (1 - mu) g (ema).
__device__ __forceinline__ float momentum_next(float m, float g, const MuonKernelSettings& s) {
  return s.ema ? __fadd_rn(__fmul_rn(s.momentum, m), __fmul_rn(s.one_minus_momentum, g))
               : __fadd_rn(__fmul_rn(s.momentum, m), g);
}
// U from g and the new M: g + mu M, (1 - mu) g + mu M (ema), or M (no Nesterov).
__device__ __forceinline__ float direction(float m, float g, const MuonKernelSettings& s) {
  if (!s.nesterov) return m;
  return s.ema ? __fadd_rn(__fmul_rn(s.one_minus_momentum, g), __fmul_rn(s.momentum, m))
               : __fadd_rn(g, __fmul_rn(s.momentum, m));
}

__device__ __forceinline__ bool skipped(const MuonScalars& sc) { return sc.device != nullptr && sc.device->skip != 0; }
__device__ __forceinline__ float grad_scale_of(const MuonScalars& sc) {
  return sc.device != nullptr ? sc.device->grad_scale : sc.grad_scale;
}
__device__ __forceinline__ float lr_of(const MuonScalars& sc) {
  return sc.device != nullptr ? sc.device->group[sc.group].lr : sc.lr;
}

// 1 / (sqrt(sum of `count` partials) + eps), the partials added in a fixed order (each
// thread's in index order, then the block's reduction): every block gets the same bits.
__device__ __forceinline__ float inverse_norm(const float* partials, int64_t count, float eps) {
  float ss = 0.0f;
  for (int64_t i = threadIdx.x; i < count; i += kThreads) ss = __fadd_rn(ss, partials[i]);
  ss = block_sum<kThreads>(ss);
  return __frcp_rn(__fadd_rn(__fsqrt_rn(ss), eps));
}

// Momentum update of one chunk and its sum of U^2 into partials[chunk].
__global__ void __launch_bounds__(kThreads)
    muon_momentum_kernel(const MuonMatrixF32* matrices, const MuonChunk* chunks, float* partials,
                         MuonKernelSettings s, MuonScalars sc) {
  if (skipped(sc)) return;
  const float gs = grad_scale_of(sc);
  const MuonChunk c = chunks[blockIdx.x];
  const MuonMatrixF32 t = matrices[c.matrix];
  const int64_t end = min(c.begin + kMuonChunk, t.n);
  const bool vec = aligned16(t.g) && aligned16(t.m);
  float ss = 0.0f;
  for (int64_t i = c.begin + kGroup * static_cast<int64_t>(threadIdx.x); i < end; i += kGroup * kThreads) {
    float g[kGroup], m[kGroup];
    load4(t.g, i, end, vec, g);
    load4(t.m, i, end, vec, m);
#pragma unroll
    for (int j = 0; j < kGroup; ++j) {
      if (i + j >= end) break;
      const float gj = __fmul_rn(g[j], gs);
      m[j] = momentum_next(m[j], gj, s);
      const float u = direction(m[j], gj, s);
      ss = __fadd_rn(ss, __fmul_rn(u, u));
    }
    store4(t.m, i, end, vec, m);
  }
  ss = block_sum<kThreads>(ss);
  if (threadIdx.x == 0) partials[blockIdx.x] = ss;
}

// U / (||U||_F + eps) of one chunk, rounded to bf16 into the matrix's iterate slot.
__global__ void __launch_bounds__(kThreads)
    muon_normalize_kernel(const MuonMatrixF32* matrices, const MuonChunk* chunks, const float* partials,
                          int64_t chunk_begin, MuonKernelSettings s, MuonScalars sc) {
  if (skipped(sc)) return;
  const float gs = grad_scale_of(sc);
  const MuonChunk c = chunks[chunk_begin + blockIdx.x];
  const MuonMatrixF32 t = matrices[c.matrix];
  const float inv = inverse_norm(partials + t.first_chunk, t.chunk_count, s.eps);
  const int64_t end = min(c.begin + kMuonChunk, t.n);
  const bool vec = aligned16(t.g) && aligned16(t.m);
  bf16* x = reinterpret_cast<bf16*>(t.x);
  for (int64_t i = c.begin + kGroup * static_cast<int64_t>(threadIdx.x); i < end; i += kGroup * kThreads) {
    float g[kGroup], m[kGroup], u[kGroup];
    load4(t.g, i, end, vec, g);
    load4(t.m, i, end, vec, m);
#pragma unroll
    for (int j = 0; j < kGroup; ++j) u[j] = __fmul_rn(direction(m[j], __fmul_rn(g[j], gs), s), inv);
    store4_bf16(x, i, end, u);
  }
}

// P = P (1 - lr wd) - lr update_scale X for one chunk, X the last iterate.
__global__ void __launch_bounds__(kThreads)
    muon_apply_kernel(const MuonMatrixF32* matrices, const MuonChunk* chunks, int64_t chunk_begin, MuonScalars sc) {
  if (skipped(sc)) return;
  const float lr = lr_of(sc);
  const MuonChunk c = chunks[chunk_begin + blockIdx.x];
  const MuonMatrixF32 t = matrices[c.matrix];
  const float decay = __fsub_rn(1.0f, __fmul_rn(lr, t.weight_decay));
  const float step = __fmul_rn(lr, t.update_scale);
  const int64_t end = min(c.begin + kMuonChunk, t.n);
  const bf16* x = reinterpret_cast<const bf16*>(t.x_final);
  if (t.p16 != nullptr) {  // a bf16 master: the same fp32 arithmetic, rounded stochastically
    const uint64_t update = sc.device != nullptr ? sc.device->group[sc.group].update : sc.update;
    for (int64_t i = c.begin + threadIdx.x; i < end; i += kThreads) {
      const float w = ops::bf16_bits_to_float(t.p16[i]);
      const float next = __fsub_rn(__fmul_rn(w, decay), __fmul_rn(step, __bfloat162float(x[i])));
      t.p16[i] = ops::stochastic_round_bf16(next, ops::rounding_bits(t.stream, update, static_cast<uint64_t>(i)));
    }
    return;
  }
  const bool vec = aligned16(t.p);
  for (int64_t i = c.begin + kGroup * static_cast<int64_t>(threadIdx.x); i < end; i += kGroup * kThreads) {
    float p[kGroup], xv[kGroup];
    load4(t.p, i, end, vec, p);
    load4_bf16(x, i, end, xv);
#pragma unroll
    for (int j = 0; j < kGroup; ++j) p[j] = __fsub_rn(__fmul_rn(p[j], decay), __fmul_rn(step, xv[j]));
    store4(t.p, i, end, vec, p);
  }
}

// ---- the standalone iteration (ops::newton_schulz) ----------------------------------------

__global__ void __launch_bounds__(kThreads) ns_sum_squares_kernel(const float* x, int64_t n, float* partials) {
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kMuonChunk, end = min(begin + kMuonChunk, n);
  const bool vec = aligned16(x);
  float ss = 0.0f;
  for (int64_t i = begin + kGroup * static_cast<int64_t>(threadIdx.x); i < end; i += kGroup * kThreads) {
    float v[kGroup];
    load4(x, i, end, vec, v);
#pragma unroll
    for (int j = 0; j < kGroup; ++j)
      if (i + j < end) ss = __fadd_rn(ss, __fmul_rn(v[j], v[j]));
  }
  ss = block_sum<kThreads>(ss);
  if (threadIdx.x == 0) partials[blockIdx.x] = ss;
}

__global__ void __launch_bounds__(kThreads)
    ns_normalize_kernel(const float* x, int64_t n, const float* partials, int64_t chunks, float eps, bf16* out) {
  const float inv = inverse_norm(partials, chunks, eps);
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kMuonChunk, end = min(begin + kMuonChunk, n);
  const bool vec = aligned16(x);
  for (int64_t i = begin + kGroup * static_cast<int64_t>(threadIdx.x); i < end; i += kGroup * kThreads) {
    float v[kGroup];
    load4(x, i, end, vec, v);
#pragma unroll
    for (int j = 0; j < kGroup; ++j) v[j] = __fmul_rn(v[j], inv);
    store4_bf16(out, i, end, v);
  }
}

__global__ void __launch_bounds__(kThreads) ns_store_kernel(const bf16* in, int64_t n, float* x) {
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kMuonChunk, end = min(begin + kMuonChunk, n);
  const bool vec = aligned16(x);
  for (int64_t i = begin + kGroup * static_cast<int64_t>(threadIdx.x); i < end; i += kGroup * kThreads) {
    float v[kGroup];
    load4_bf16(in, i, end, v);
    store4(x, i, end, vec, v);
  }
}

// ---- the iteration's GEMMs ----------------------------------------------------------------

// ns_steps steps on the batch's iterates, x0 first: step s reads x[s % 2] and writes
// x[(s + 1) % 2], so the last iterate is in x1 after an odd count, x0 after an even one.
// Per step three strided-batched bf16 GEMMs with fp32 accumulation, each one cuBLASLt call
// with its beta term (C read, D written elsewhere where the output is a new buffer):
//   wide: A = X X^T;   B = c A A + b A (C = A, D = B);   X' = B X + a X (C = X, D = X')
//   tall: A = X^T X;   B as above;                      X' = X B + a X
void ns_iterations(const ExecContext& ctx, const MuonBatchF32& b, int steps) {
  const float ka = static_cast<float>(ops::kNewtonSchulzA), kb = static_cast<float>(ops::kNewtonSchulzB),
              kc = static_cast<float>(ops::kNewtonSchulzC);
  const bool wide = b.rows <= b.cols;
  const int64_t n = wide ? b.rows : b.cols;  // the Gram matrices are [n, n]
  const DType t = DType::bf16;
  const int64_t sx = b.stride_x, sa = b.stride_a, cols = b.cols;
  for (int s = 0; s < steps; ++s) {
    const bf16_bits* x = s % 2 ? b.x1 : b.x0;
    bf16_bits* y = s % 2 ? b.x0 : b.x1;
    if (wide)
      gemm_strided_batched(ctx, false, true, n, n, cols, 1.0f, x, cols, sx, x, cols, sx, t, 0.0f, nullptr, b.a, n, sa, t,
                           b.count);
    else
      gemm_strided_batched(ctx, true, false, n, n, b.rows, 1.0f, x, cols, sx, x, cols, sx, t, 0.0f, nullptr, b.a, n, sa, t,
                           b.count);
    gemm_strided_batched(ctx, false, false, n, n, n, kc, b.a, n, sa, b.a, n, sa, t, kb, b.a, b.b, n, sa, t, b.count);
    if (wide)
      gemm_strided_batched(ctx, false, false, b.rows, cols, b.rows, 1.0f, b.b, n, sa, x, cols, sx, t, ka, x, y, cols, sx, t,
                           b.count);
    else
      gemm_strided_batched(ctx, false, false, b.rows, cols, cols, 1.0f, x, cols, sx, b.b, n, sa, t, ka, x, y, cols, sx, t,
                           b.count);
  }
}

int64_t chunks_of(int64_t n) { return (n + kMuonChunk - 1) / kMuonChunk; }
int64_t padded(int64_t elements) { return (elements + kMuonSlotAlign - 1) / kMuonSlotAlign * kMuonSlotAlign; }
unsigned grid_of(int64_t blocks) {
  KILN_CHECK(blocks > 0 && blocks <= 0x7fffffff, "muon", "{} chunks exceed the grid", blocks);
  return static_cast<unsigned>(blocks);
}

}  // namespace

void muon_momentum_f32(const ExecContext& ctx, const MuonDeviceTable& table, const MuonKernelSettings& settings, const MuonScalars& scalars) {
  if (table.chunk_count == 0) return;
  muon_momentum_kernel<<<grid_of(table.chunk_count), kThreads, 0, stream(ctx)>>>(table.matrices, table.chunks,
                                                                               table.partials, settings, scalars);
  check_launch("muon", "muon_momentum_kernel");
}

void muon_orthogonalize_apply_f32(const ExecContext& ctx, const MuonDeviceTable& table, const MuonBatchF32& batch,
                                  const MuonKernelSettings& settings, const MuonScalars& scalars) {
  const int64_t blocks = batch.chunk_end - batch.chunk_begin;
  if (blocks == 0) return;
  muon_normalize_kernel<<<grid_of(blocks), kThreads, 0, stream(ctx)>>>(table.matrices, table.chunks, table.partials,
                                                                     batch.chunk_begin, settings, scalars);
  check_launch("muon", "muon_normalize_kernel");
  // Skipped steps still run the GEMMs (on whatever the workspace holds): no host read of
  // the flag, and nothing they write is read by the skipped update.
  ns_iterations(ctx, batch, settings.ns_steps);
  muon_apply_kernel<<<grid_of(blocks), kThreads, 0, stream(ctx)>>>(table.matrices, table.chunks, batch.chunk_begin,
                                                                 scalars);
  check_launch("muon", "muon_apply_kernel");
}

// Workspace: the chunks' partial sums (padded to 256 bytes), then x0, x1, a, b.
size_t newton_schulz_workspace_bytes(int64_t rows, int64_t cols) {
  const int64_t n = rows < cols ? rows : cols;
  const size_t partials = static_cast<size_t>((chunks_of(rows * cols) * 4 + 255) / 256 * 256);
  return partials + 2 * static_cast<size_t>(2 * padded(rows * cols) + 2 * padded(n * n));
}

void newton_schulz_f32(const ExecContext& ctx, float* x, int64_t rows, int64_t cols, int steps, float eps, void* workspace) {
  const int64_t count = rows * cols, chunks = chunks_of(count), n = rows < cols ? rows : cols;
  if (count == 0) return;
  auto* partials = static_cast<float*>(workspace);
  auto* base = reinterpret_cast<bf16_bits*>(static_cast<char*>(workspace) + (chunks * 4 + 255) / 256 * 256);
  MuonBatchF32 batch{rows, cols, 0, 1, 0, chunks, nullptr, nullptr, nullptr, nullptr, padded(count), padded(n * n)};
  batch.x0 = base;
  batch.x1 = batch.x0 + batch.stride_x;
  batch.a = batch.x1 + batch.stride_x;
  batch.b = batch.a + batch.stride_a;
  ns_sum_squares_kernel<<<grid_of(chunks), kThreads, 0, stream(ctx)>>>(x, count, partials);
  check_launch("newton_schulz", "ns_sum_squares_kernel");
  ns_normalize_kernel<<<grid_of(chunks), kThreads, 0, stream(ctx)>>>(x, count, partials, chunks, eps,
                                                                   reinterpret_cast<bf16*>(batch.x0));
  check_launch("newton_schulz", "ns_normalize_kernel");
  ns_iterations(ctx, batch, steps);
  ns_store_kernel<<<grid_of(chunks), kThreads, 0, stream(ctx)>>>(
      reinterpret_cast<const bf16*>(steps % 2 ? batch.x1 : batch.x0), count, x);
  check_launch("newton_schulz", "ns_store_kernel");
}

}  // namespace kiln::cuda

// KDA kernels (declared in kda_cuda.h): the token-by-token recurrence of
// kda_recurrent.cpp on the GPU, and the decay gate of kda_gate.cpp.
//
// Recurrence (the block's layout and step live in kda_recurrent_step.cuh, shared with the
// decode kernel): one block of 128 threads (4 warps) per (d_v slice, head, document). A
// lane owns R = ceil(d_k / 32) rows of the state (i = lane + 32 r), a warp C = 16 / R
// columns, so every thread holds 16 fp32 state values in registers and a block a slice of
// BV = 4 C columns. Each token: the decay, the misprediction w_j = v_j - sum_i k_i S'_ij
// and the read-out o_j = scale sum_i q_i S_ij are warp reductions over rows (xor
// butterflies: every lane gets the same bits), the rank-1 update is per thread.
//
// Backward (reverse time, as the CPU reference): the forward kernel first writes the state
// before every 64th token of each document into the workspace; then per 64-token block,
// last to first, the block replays its tokens from that checkpoint keeping the state
// before every 8th token in shared memory, and per 8-token piece, last to first, replays
// it keeping each token's S_{t-1} (shared memory again, each thread its own values), then
// walks the piece backwards carrying dS in registers. dv is per column (written
// directly); dq, dk, dg and dbeta sum over d_v: over a warp's columns in registers, over
// the block's 4 warps in shared memory in warp order, and over the d_v slices by a second
// kernel that adds the slices' partials (workspace) in slice order. No atomics anywhere.
//
// Gate: the forward is elementwise; the backward walks chunks of tokens with a thread per
// channel, then adds the chunks' partial sums in a fixed order (context scratch).
#include "ops/kda/kda_cuda.h"

#include "core/cuda_check.h"
#include "core/context_scratch.h"
#include "core/cuda_context.h"
#include "core/error.h"
#include "ops/bf16_vector.cuh"
#include "ops/kda/kda_recurrent_step.cuh"

#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>

namespace kiln::cuda {

namespace {

using namespace kda_step;  // the block's layout and the step (kda_recurrent_step.cuh)

constexpr int kCheckpoint = 64;  // tokens between the states the backward keeps in global memory
constexpr int kPiece = 8;        // tokens between the states a backward block keeps in shared memory
constexpr int kPieces = kCheckpoint / kPiece;

int64_t checkpoint_slots(int64_t tokens, int64_t num_seqs) { return tokens / kCheckpoint + num_seqs; }

// The first checkpoint slot of document `seq` starting at token `begin`: floor(begin / 64)
// + seq, so a document of L tokens owns ceil(L / 64) slots before the next one's first.
__device__ __forceinline__ int64_t first_slot(int64_t begin, int64_t seq) { return begin / kCheckpoint + seq; }

// This thread's values in per-thread shared-memory slot `slot` (conflict-free: thread-minor).
template <int R, int C>
__device__ __forceinline__ void to_shared(float* sm, int slot, const float (&S)[R][C]) {
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int c = 0; c < C; ++c) sm[(slot * kRegs + r * C + c) * kThreads + threadIdx.x] = S[r][c];
}

template <int R, int C>
__device__ __forceinline__ void from_shared(const float* sm, int slot, float (&S)[R][C]) {
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int c = 0; c < C; ++c) S[r][c] = sm[(slot * kRegs + r * C + c) * kThreads + threadIdx.x];
}

// Forward over one document, head and slice: out (null: not written), the final state ht
// (null: not written), and with `checkpoints` the state before every 64th token.
template <typename T, int R>
__global__ void __launch_bounds__(kThreads) kda_forward_kernel(KdaArgs s, const T* q, const T* k, const T* v,
                                                               const T* g, const T* beta, const float* h0, T* out,
                                                               float* ht, float* checkpoints) {
  constexpr int C = kRegs / R;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t h = blockIdx.y, seq = blockIdx.z, H = s.heads;
  const int64_t j0 = blockIdx.x * int64_t{kWarps * C} + warp * C;
  const int64_t begin = s.cu_seqlens[seq], end = s.cu_seqlens[seq + 1];
  const int64_t state = (seq * H + h) * s.dk * s.dv, slot0 = first_slot(begin, seq);
  float S[R][C], w[C];
  load_state<R, C>(s, h0 ? h0 + state : nullptr, lane, j0, S);
  for (int64_t t = begin; t < end; ++t) {
    if (checkpoints && (t - begin) % kCheckpoint == 0)
      store_state<R, C>(s, checkpoints + ((slot0 + (t - begin) / kCheckpoint) * H + h) * s.dk * s.dv, lane, j0, S);
    const int64_t row = t * H + h;
    Token<T, R, C> x;
    x.load(s, q, k, v, g, beta, row, lane, j0);
    step(x, S, w);
    if (out) read_out(s, x, S, lane, j0, out + row * s.dv);
  }
  if (ht) store_state<R, C>(s, ht + state, lane, j0, S);
}

// Shared memory of the backward: kPieces piece checkpoints and kPiece token states, each
// kRegs x kThreads floats, then the cross-warp partials [kWarps][3 d_k] and [kWarps].
size_t backward_shared_bytes(int64_t dk) {
  return (size_t{2} * kPieces * kRegs * kThreads + size_t(kWarps) * (3 * dk + 1)) * sizeof(float);
}

// Partial sums over this slice's columns: dq, dk, dg [slices, N, H, d_k], then dbeta [slices, N, H].
struct Partials {
  float *dq, *dk, *dg, *dbeta;
};

__host__ __device__ inline Partials partials_of(float* base, int64_t slices_, int64_t rows, int64_t dk) {
  const int64_t n = slices_ * rows * dk;
  return {base, base + n, base + 2 * n, base + 3 * n};
}

template <typename T, int R>
__global__ void __launch_bounds__(kThreads) kda_backward_kernel(KdaArgs s, const T* q, const T* k, const T* v,
                                                                const T* g, const T* beta, const T* dout,
                                                                const float* dht, T* dv, float* dh0,
                                                                const float* checkpoints, Partials part) {
  constexpr int C = kRegs / R;
  extern __shared__ float sm[];
  float* pieces = sm;                                       // kPieces slots
  float* states = sm + kPieces * kRegs * kThreads;          // kPiece slots
  float* red = sm + 2 * kPieces * kRegs * kThreads;         // [kWarps][3][d_k]
  float* red_beta = red + kWarps * 3 * s.dk;                // [kWarps]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t h = blockIdx.y, seq = blockIdx.z, H = s.heads, dk = s.dk, rows = s.tokens * H;
  const int64_t slice = blockIdx.x, j0 = slice * int64_t{kWarps * C} + warp * C;
  const int64_t begin = s.cu_seqlens[seq], end = s.cu_seqlens[seq + 1];
  const int64_t state = (seq * H + h) * dk * s.dv, slot0 = first_slot(begin, seq);
  float S[R][C], dS[R][C], w[C];
  load_state<R, C>(s, dht ? dht + state : nullptr, lane, j0, dS);
  const int64_t blocks = (end - begin + kCheckpoint - 1) / kCheckpoint;
  for (int64_t b = blocks - 1; b >= 0; --b) {
    const int64_t first = begin + b * kCheckpoint, last = end < first + kCheckpoint ? end : first + kCheckpoint;
    const int npieces = static_cast<int>((last - first + kPiece - 1) / kPiece);
    load_state<R, C>(s, checkpoints + ((slot0 + b) * H + h) * dk * s.dv, lane, j0, S);
    for (int64_t t = first; t < first + int64_t{npieces - 1} * kPiece; ++t) {
      if ((t - first) % kPiece == 0) to_shared<R, C>(pieces, static_cast<int>((t - first) / kPiece), S);
      Token<T, R, C> x;
      x.load(s, q, k, v, g, beta, t * H + h, lane, j0);
      step(x, S, w);
    }
    to_shared<R, C>(pieces, npieces - 1, S);
    for (int p = npieces - 1; p >= 0; --p) {
      const int64_t pf = first + int64_t{p} * kPiece, pl = last < pf + kPiece ? last : pf + kPiece;
      from_shared<R, C>(pieces, p, S);
      for (int64_t t = pf; t < pl; ++t) {
        to_shared<R, C>(states, static_cast<int>(t - pf), S);
        if (t + 1 == pl) break;
        Token<T, R, C> x;
        x.load(s, q, k, v, g, beta, t * H + h, lane, j0);
        step(x, S, w);
      }
      for (int64_t t = pl - 1; t >= pf; --t) {
        const int64_t row = t * H + h;
        Token<T, R, C> x;
        x.load(s, q, k, v, g, beta, row, lane, j0);
        from_shared<R, C>(states, static_cast<int>(t - pf), S);
        // S' (in S), w and d of this step.
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
          for (int c = 0; c < C; ++c) S[r][c] *= x.a[r];
        float d[C], dov[C];
#pragma unroll
        for (int c = 0; c < C; ++c) {
          float pw = 0.f;
#pragma unroll
          for (int r = 0; r < R; ++r) pw += x.k[r] * S[r][c];
          w[c] = x.v[c] - warp_sum(pw);
          d[c] = x.beta * w[c];
          dov[c] = j0 + c < s.dv ? to_f32(dout[row * s.dv + j0 + c]) : 0.f;
        }
        // Output: dq = scale S_t do (this slice's columns); dS += scale q do^T.
        float pq[R], pk[R], pg[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
          float acc = 0.f;
#pragma unroll
          for (int c = 0; c < C; ++c) {
            acc += (S[r][c] + x.k[r] * d[c]) * dov[c];
            dS[r][c] += s.scale * x.q[r] * dov[c];
          }
          pq[r] = s.scale * acc;
        }
        // dd = dS^T k; dbeta = dd . w; dw = beta dd = dv.
        float dw[C], pb = 0.f;
#pragma unroll
        for (int c = 0; c < C; ++c) {
          float pd = 0.f;
#pragma unroll
          for (int r = 0; r < R; ++r) pd += dS[r][c] * x.k[r];
          const float dd = warp_sum(pd);
          pb += dd * w[c];
          dw[c] = x.beta * dd;
          if (lane == c && j0 + c < s.dv) from_f32(dw[c], dv + row * s.dv + j0 + c);
        }
        // dk = dS d - S' dw; dS' = dS - k dw^T; dg = rowsum(S' . dS'); dS_{t-1} = Diag(a) dS'.
#pragma unroll
        for (int r = 0; r < R; ++r) {
          float acc = 0.f, dgi = 0.f;
#pragma unroll
          for (int c = 0; c < C; ++c) {
            acc += dS[r][c] * d[c] - S[r][c] * dw[c];
            const float dsp = dS[r][c] - x.k[r] * dw[c];
            dgi += S[r][c] * dsp;
            dS[r][c] = x.a[r] * dsp;
          }
          pk[r] = acc;
          pg[r] = dgi;
        }
        // The block's sum over its warps, in warp order, then this slice's partials.
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const int64_t i = lane + 32 * r;
          if (i < dk) {
            red[(warp * 3 + 0) * dk + i] = pq[r];
            red[(warp * 3 + 1) * dk + i] = pk[r];
            red[(warp * 3 + 2) * dk + i] = pg[r];
          }
        }
        if (lane == 0) red_beta[warp] = pb;
        __syncthreads();
        for (int64_t i = threadIdx.x; i < dk; i += kThreads) {
          float sq = 0.f, sk = 0.f, sg = 0.f;
          for (int u = 0; u < kWarps; ++u) {
            sq += red[(u * 3 + 0) * dk + i];
            sk += red[(u * 3 + 1) * dk + i];
            sg += red[(u * 3 + 2) * dk + i];
          }
          const int64_t at = (slice * rows + row) * dk + i;
          part.dq[at] = sq;
          part.dk[at] = sk;
          part.dg[at] = sg;
        }
        if (threadIdx.x == 0) {
          float sb = 0.f;
          for (int u = 0; u < kWarps; ++u) sb += red_beta[u];
          part.dbeta[slice * rows + row] = sb;
        }
        __syncthreads();
      }
    }
  }
  if (dh0) store_state<R, C>(s, dh0 + state, lane, j0, dS);
}

// out[e] = sum over slices of partial[slice][e], in slice order, stored as T.
template <typename T>
__global__ void sum_slices_kernel(const float* partial, int64_t slices_, int64_t n, T* out) {
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < n; e += int64_t{gridDim.x} * blockDim.x) {
    float acc = 0.f;
    for (int64_t u = 0; u < slices_; ++u) acc += partial[u * n + e];
    from_f32(acc, out + e);
  }
}

template <typename T, int R>
void forward_launch(const ExecContext& ctx, const KdaArgs& a, const void* q, const void* k, const void* v,
                    const void* g, const void* beta, const float* h0, void* out, float* ht, float* checkpoints) {
  const dim3 grid(static_cast<unsigned>(slices(a.dk, a.dv)), static_cast<unsigned>(a.heads),
                  static_cast<unsigned>(a.num_seqs));
  kda_forward_kernel<T, R><<<grid, kThreads, 0, stream(ctx)>>>(
      a, static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), static_cast<const T*>(g),
      static_cast<const T*>(beta), h0, static_cast<T*>(out), ht, checkpoints);
  check_launch("kda_recurrent_forward", "kda_forward_kernel");
}

template <typename T, int R>
void backward_launch(const ExecContext& ctx, const KdaArgs& a, const void* q, const void* k, const void* v,
                     const void* g, const void* beta, const float* h0, const void* dout, const float* dht, void* dq,
                     void* dk, void* dv, void* dg, void* dbeta, float* dh0, float* workspace) {
  const int64_t n_slices = slices(a.dk, a.dv), rows = a.tokens * a.heads;
  float* checkpoints = workspace;
  const Partials part =
      partials_of(workspace + checkpoint_slots(a.tokens, a.num_seqs) * a.heads * a.dk * a.dv, n_slices, rows, a.dk);
  forward_launch<T, R>(ctx, a, q, k, v, g, beta, h0, nullptr, nullptr, checkpoints);
  const dim3 grid(static_cast<unsigned>(n_slices), static_cast<unsigned>(a.heads), static_cast<unsigned>(a.num_seqs));
  const size_t smem = backward_shared_bytes(a.dk);
  check(cudaFuncSetAttribute(kda_backward_kernel<T, R>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(smem)),
        "kda_recurrent_backward", "cudaFuncSetAttribute");
  kda_backward_kernel<T, R><<<grid, kThreads, smem, stream(ctx)>>>(
      a, static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), static_cast<const T*>(g),
      static_cast<const T*>(beta), static_cast<const T*>(dout), dht, static_cast<T*>(dv), dh0, checkpoints, part);
  check_launch("kda_recurrent_backward", "kda_backward_kernel");
  if (rows == 0) return;
  const int threads = 256;
  const int64_t n = rows * a.dk;
  sum_slices_kernel<T><<<blocks_for(n, threads), threads, 0, stream(ctx)>>>(part.dq, n_slices, n, static_cast<T*>(dq));
  sum_slices_kernel<T><<<blocks_for(n, threads), threads, 0, stream(ctx)>>>(part.dk, n_slices, n, static_cast<T*>(dk));
  sum_slices_kernel<T><<<blocks_for(n, threads), threads, 0, stream(ctx)>>>(part.dg, n_slices, n, static_cast<T*>(dg));
  sum_slices_kernel<T>
      <<<blocks_for(rows, threads), threads, 0, stream(ctx)>>>(part.dbeta, n_slices, rows, static_cast<T*>(dbeta));
  check_launch("kda_recurrent_backward", "sum_slices_kernel");
}

// ---- gate --------------------------------------------------------------------------------

__device__ __forceinline__ float softplus(float x) { return fmaxf(x, 0.f) + log1pf(expf(-fabsf(x))); }
__device__ __forceinline__ float sigmoid(float x) {
  return x >= 0.f ? 1.f / (1.f + expf(-x)) : expf(x) / (1.f + expf(x));
}

template <typename T>
__global__ void gate_forward_kernel(const T* raw, const float* A_log, const float* dt_bias, int64_t n, int64_t heads,
                                    int64_t dk, T* g) {
  const int64_t row = heads * dk;
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < n; e += int64_t{gridDim.x} * blockDim.x) {
    const int64_t c = e % row, h = c / dk;
    const float x = to_f32(raw[e]) + (dt_bias ? dt_bias[c] : 0.f);
    from_f32(-expf(A_log[h]) * softplus(x), g + e);
  }
}

// The backward in two passes, deterministic without atomics: a thread per channel walks one
// chunk of tokens (coalesced across channels), writing draw and its chunk's two sums per
// channel; then per channel the chunks' sums are added in chunk order (into ddt_bias, and
// the dA_log shares kept), and per head its channels' shares in channel order.
constexpr int64_t kGateScratchFloats = int64_t{1} << 20;
const ScratchKind kGatePartials{"kda_gate_backward partials", kGateScratchFloats * sizeof(float)};

template <typename T>
__global__ void gate_backward_chunk_kernel(const T* raw, const float* A_log, const float* dt_bias, const T* dg,
                                           int64_t tokens, int64_t heads, int64_t dk, int64_t len, T* draw,
                                           float* partials) {
  const int64_t row = heads * dk, c = blockIdx.x * int64_t{blockDim.x} + threadIdx.x, chunk = blockIdx.y;
  if (c >= row) return;
  const float rate = expf(A_log[c / dk]), bias = dt_bias ? dt_bias[c] : 0.f;
  float sum_b = 0.f, sum_a = 0.f;
  const int64_t end = (chunk + 1) * len < tokens ? (chunk + 1) * len : tokens;
  for (int64_t t = chunk * len; t < end; ++t) {
    const float x = to_f32(raw[t * row + c]) + bias, dy = to_f32(dg[t * row + c]);
    const float dx = -rate * sigmoid(x) * dy;
    from_f32(dx, draw + t * row + c);
    sum_b += dx;
    sum_a += -rate * softplus(x) * dy;
  }
  partials[(chunk * 2) * row + c] = sum_b;
  partials[(chunk * 2 + 1) * row + c] = sum_a;
}

// Per channel: the chunks' sums in order; ddt_bias += the first, the second kept in shares.
__global__ void gate_backward_channel_kernel(const float* partials, int64_t chunks, int64_t row, float* ddt_bias,
                                             float* shares) {
  const int64_t c = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (c >= row) return;
  float sum_b = 0.f, sum_a = 0.f;
  for (int64_t u = 0; u < chunks; ++u) {
    sum_b += partials[(u * 2) * row + c];
    sum_a += partials[(u * 2 + 1) * row + c];
  }
  if (ddt_bias) ddt_bias[c] += sum_b;
  shares[c] = sum_a;
}

// Per head: dA_log += its channels' shares in channel order.
__global__ void gate_backward_head_kernel(const float* shares, int64_t heads, int64_t dk, float* dA_log) {
  const int64_t h = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (h >= heads) return;
  float total = 0.f;
  for (int64_t i = 0; i < dk; ++i) total += shares[h * dk + i];
  dA_log[h] += total;
}

}  // namespace

void kda_recurrent_forward(const ExecContext& ctx, const KdaArgs& a, const void* q, const void* k, const void* v,
                           const void* g, const void* beta, const float* h0, void* out, float* ht) {
  if (a.num_seqs == 0 || a.heads == 0 || a.dv == 0) return;
  dispatch("kda_recurrent_forward", a.dtype, a.dk, [&]<typename T, int R>() {
    forward_launch<T, R>(ctx, a, q, k, v, g, beta, h0, out, ht, nullptr);
  });
}

int64_t kda_backward_workspace_elems(int64_t tokens, int64_t heads, int64_t dk, int64_t dv, int64_t num_seqs) {
  return checkpoint_slots(tokens, num_seqs) * heads * dk * dv + slices(dk, dv) * tokens * heads * (3 * dk + 1);
}

void kda_recurrent_backward(const ExecContext& ctx, const KdaArgs& a, const void* q, const void* k, const void* v,
                            const void* g, const void* beta, const float* h0, const void* dout, const float* dht,
                            void* dq, void* dk, void* dv, void* dg, void* dbeta, float* dh0, float* workspace) {
  if (a.num_seqs == 0 || a.heads == 0 || a.dv == 0) return;
  dispatch("kda_recurrent_backward", a.dtype, a.dk, [&]<typename T, int R>() {
    backward_launch<T, R>(ctx, a, q, k, v, g, beta, h0, dout, dht, dq, dk, dv, dg, dbeta, dh0, workspace);
  });
}

void kda_gate_forward(const ExecContext& ctx, const void* raw, DType dtype, const float* A_log, const float* dt_bias,
                      int64_t tokens, int64_t heads, int64_t dk, void* g) {
  const int64_t n = tokens * heads * dk;
  if (n == 0) return;
  const int threads = 256;
  if (dtype == DType::f32)
    gate_forward_kernel<float><<<blocks_for(n, threads), threads, 0, stream(ctx)>>>(
        static_cast<const float*>(raw), A_log, dt_bias, n, heads, dk, static_cast<float*>(g));
  else
    gate_forward_kernel<bf16><<<blocks_for(n, threads), threads, 0, stream(ctx)>>>(
        static_cast<const bf16*>(raw), A_log, dt_bias, n, heads, dk, static_cast<bf16*>(g));
  check_launch("kda_gate_forward", "gate_forward_kernel");
}

void kda_gate_backward(const ExecContext& ctx, const void* raw, DType dtype, const float* A_log,
                       const float* dt_bias, const void* dg, int64_t tokens, int64_t heads, int64_t dk, void* draw,
                       float* dA_log, float* ddt_bias) {
  const char* op = "kda_gate_backward";
  const int64_t row = heads * dk;
  if (row == 0) return;
  // Chunks depend on the shape only, so the order of the parameter sums does too.
  const int64_t fit = (kGateScratchFloats - row) / (2 * row);
  KILN_CHECK(fit >= 1, op, "{} channels exceed the partial sums' scratch", row);
  const int64_t chunks = std::max<int64_t>(1, std::min({int64_t{256}, (tokens + 63) / 64, fit}));
  const int64_t len = (tokens + chunks - 1) / chunks;
  float* partials = context_scratch_as<float>(ctx, kGatePartials);
  float* shares = partials + 2 * chunks * row;
  const int threads = 128;
  const dim3 grid(static_cast<unsigned>((row + threads - 1) / threads), static_cast<unsigned>(chunks));
  if (dtype == DType::f32)
    gate_backward_chunk_kernel<float><<<grid, threads, 0, stream(ctx)>>>(
        static_cast<const float*>(raw), A_log, dt_bias, static_cast<const float*>(dg), tokens, heads, dk, len,
        static_cast<float*>(draw), partials);
  else
    gate_backward_chunk_kernel<bf16><<<grid, threads, 0, stream(ctx)>>>(
        static_cast<const bf16*>(raw), A_log, dt_bias, static_cast<const bf16*>(dg), tokens, heads, dk, len,
        static_cast<bf16*>(draw), partials);
  check_launch(op, "gate_backward_chunk_kernel");
  gate_backward_channel_kernel<<<blocks_for(row, threads), threads, 0, stream(ctx)>>>(partials, chunks, row, ddt_bias,
                                                                                      shares);
  check_launch(op, "gate_backward_channel_kernel");
  if (!dA_log) return;
  gate_backward_head_kernel<<<blocks_for(heads, threads), threads, 0, stream(ctx)>>>(shares, heads, dk, dA_log);
  check_launch(op, "gate_backward_head_kernel");
}

}  // namespace kiln::cuda

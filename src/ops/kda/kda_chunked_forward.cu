// Chunked KDA: the output kernels (o = scale (Gamma q S_0 + P D) per chunk; the overview is
// kda_chunked_common.cuh's), in fp32 SIMT and on the tensor cores, and the forward:
// factors_and_states, then output.
#include "ops/kda/kda_chunked_common.cuh"

namespace kiln::cuda {

namespace kda_chunked {

namespace {

// One block per (chunk, head). Shared: Qg [C, d_k]; with Staged (where the card has the
// room) the chunk's S_0 [d_k, d_v], P [C, C] and D [C, d_v] too, copied in while Qg is
// formed: each output element reads a column of S_0 and of D and a row of P.
template <typename T, bool Staged>
__global__ void __launch_bounds__(kThreads) output_kernel(KdaArgs s, Tiles w, const T* q, const T* g, T* out) {
  extern __shared__ float sm[];
  Chunk c;
  if (!locate(s, blockIdx.x, c)) return;
  const int64_t h = blockIdx.y, H = s.heads, dk = s.dk, dv = s.dv, at = c.slot * H + h;
  float* qg = sm;
  const float* S0 = w.S0 + at * w.kv;
  const float* P = w.P + at * w.cc;
  const float* D = w.D + at * w.cv;
  if constexpr (Staged) {
    float* S0_sh = qg + kC * dk;
    float* P_sh = S0_sh + dk * dv;
    float* D_sh = P_sh + kC * kC;
    start_copy(S0_sh, dv, S0, dv, dk, dv);
    start_copy(P_sh, kC, P, kC, c.len, kC);
    start_copy(D_sh, dv, D, dv, c.len, dv);
    S0 = S0_sh, P = P_sh, D = D_sh;
  }
  cumulative_decay(dk, rows_of(g, s, c, h, dk), c.len, qg, dk);
  for (int64_t i = threadIdx.x; i < dk; i += blockDim.x)
    for (int64_t r = 0; r < c.len; ++r)
      qg[r * dk + i] = expf(qg[r * dk + i]) * to_f32(q[((c.first + r) * H + h) * dk + i]);
  if constexpr (Staged) __pipeline_wait_prior(0);
  __syncthreads();
  for (int64_t e = threadIdx.x; e < c.len * dv; e += blockDim.x) {
    const int64_t r = e / dv, j = e % dv;
    float acc = 0.f;
    for (int64_t i = 0; i < dk; ++i) acc += qg[r * dk + i] * S0[i * dv + j];
    for (int64_t col = 0; col <= r; ++col) acc += P[r * kC + col] * D[col * dv + j];
    from_f32(s.scale * acc, out + ((c.first + r) * H + h) * dv + j);
  }
}

// output_kernel on the tensor cores: o = scale (Qg S_0 + P D), both products by block_mma
// from S_0, P and D in the workspace (P's columns and D's rows past len are zero there).
// Shared: Qg [C, d_k] and o [C, d_v], rows 4 floats longer than the tiles (fewer bank
// conflicts for wmma's loads).
template <typename T>
__global__ void __launch_bounds__(kThreads) output_tf32_kernel(KdaArgs s, Tiles w, const T* q, const T* g, T* out) {
  using block_mma::product;
  extern __shared__ float sm[];
  Chunk c;
  if (!locate(s, blockIdx.x, c)) return;
  const int64_t h = blockIdx.y, H = s.heads, dk = s.dk, dv = s.dv, at = c.slot * H + h;
  const int64_t qld = dk + 4, old = dv + 4;
  float* qg = sm;
  float* o = qg + kC * qld;
  cumulative_decay(dk, rows_of(g, s, c, h, dk), c.len, qg, qld);
  for (int64_t i = threadIdx.x; i < dk; i += blockDim.x)
    for (int64_t r = 0; r < c.len; ++r)
      qg[r * qld + i] = expf(qg[r * qld + i]) * to_f32(q[((c.first + r) * H + h) * dk + i]);
  product<Engine::tf32, Layout::rows, Layout::rows>(kC, dv, kC, 1.f, w.P + at * w.cc, kC, w.D + at * w.cv, dv, 0.f,
                                                    o, old);
  __syncthreads();  // Qg's rows; each warp also reads back the o tiles it stored
  product<Engine::tf32, Layout::rows, Layout::rows>(kC, dv, dk, 1.f, qg, qld, w.S0 + at * w.kv, dv, 1.f, o, old);
  __syncthreads();
  for (int64_t e = threadIdx.x; e < c.len * dv; e += blockDim.x) {
    const int64_t r = e / dv, j = e % dv;
    from_f32(s.scale * o[r * old + j], out + ((c.first + r) * H + h) * dv + j);
  }
}

template <typename T>
void forward_launch(const ExecContext& ctx, const KdaArgs& a, const T* q, const T* k, const T* v, const T* g,
                    const T* beta, const float* h0, T* out, float* ht, float* workspace) {
  const char* op = "kda_chunked_forward";
  const Tiles w = tiles_of(workspace, slots_of(a.tokens, a.num_seqs) * a.heads, a.dk, a.dv);
  factors_and_states<T>(ctx, a, w, q, k, v, g, beta, h0, ht, /*transposed=*/false, /*query_tiles=*/false,
                        sequential_slice(a, engine_of<T>(a), op), op);
  if (a.tokens == 0) return;
  if constexpr (std::is_same_v<T, bf16>)
    if (engine_of<T>(a) == Engine::tf32) {
      const size_t bytes = floats(kC * (a.dk + 4) + kC * (a.dv + 4));
      allow_shared(output_tf32_kernel<T>, bytes, op);
      output_tf32_kernel<T><<<chunks_grid(a), kThreads, bytes, stream(ctx)>>>(a, w, q, g, out);
      check_launch(op, "output_tf32_kernel");
      return;
    }
  const size_t smem = floats(kC * a.dk), staged = smem + floats(a.dk * a.dv + kC * kC + kC * a.dv);
  if (staged <= shared_limit(op)) {
    allow_shared(output_kernel<T, true>, staged, op);
    output_kernel<T, true><<<chunks_grid(a), kThreads, staged, stream(ctx)>>>(a, w, q, g, out);
  } else {
    allow_shared(output_kernel<T, false>, smem, op);
    output_kernel<T, false><<<chunks_grid(a), kThreads, smem, stream(ctx)>>>(a, w, q, g, out);
  }
  check_launch(op, "output_kernel");
}

}  // namespace

}  // namespace kda_chunked

int64_t kda_chunked_workspace_elems(int64_t tokens, int64_t heads, int64_t dk, int64_t dv, int64_t num_seqs) {
  using namespace kda_chunked;
  return tiles_elems(slots_of(tokens, num_seqs) * heads, dk, dv);
}

void kda_chunked_forward(const ExecContext& ctx, const KdaArgs& a, const void* q, const void* k, const void* v,
                         const void* g, const void* beta, const float* h0, void* out, float* ht, float* workspace) {
  using namespace kda_chunked;
  if (a.num_seqs == 0 || a.heads == 0 || a.dv == 0) return;
  KILN_CHECK(a.dk >= 1 && a.dk <= kKdaChunkedMaxDk, "kda_chunked_forward", "d_k must be 1..{} on the GPU, got {}",
             kKdaChunkedMaxDk, a.dk);
  by_dtype(a.dtype, [&]<typename T>() {
    forward_launch<T>(ctx, a, static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v),
                      static_cast<const T*>(g), static_cast<const T*>(beta), h0, static_cast<T*>(out), ht, workspace);
  });
}

}  // namespace kiln::cuda

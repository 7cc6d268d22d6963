// Chunked KDA: the state_grads kernels (per document, chunks in reverse: dS at each chunk's
// end and dD; the overview is kda_chunked_common.cuh's), in fp32 SIMT (state_grads_kernel)
// and on the tensor cores (state_grads_tf32_kernel), and their launch.
#include "ops/kda/kda_chunked_common.cuh"

namespace kiln::cuda::kda_chunked {

namespace {

// One block per (d_v slice, head, document), chunks in reverse. Shared: the chunk's W [C,
// d_k], P [C, C] and dO slice [C, Slice] (copied in first, as in states_kernel), Kd [C, d_k]
// (rows padded_ld apart), Qg [C, d_k], elast [d_k], dS [d_k, Slice], dD [C, Slice]; with
// Staged the chunk's g, q and k rows, T [C, d_k] each, as in states_kernel.
template <typename T, int Slice, bool Staged>
__global__ void __launch_bounds__(kThreads) state_grads_kernel(KdaArgs s, Tiles w, const T* q, const T* k,
                                                               const T* g, const T* dout, const float* dht,
                                                               float* dh0) {
  using Lane = SliceLane<Slice>;
  extern __shared__ float sm[];
  const int64_t h = blockIdx.y, seq = blockIdx.z, H = s.heads, dk = s.dk, dv = s.dv, j0 = blockIdx.x * Slice;
  float* W = sm;
  float* P = W + kC * dk;
  float* dos = P + kC * kC;
  const int64_t kld = padded_ld(dk);
  float* kd = dos + kC * Slice;
  float* qg = kd + kC * kld;
  float* elast = qg + kC * dk;
  float* dS = elast + dk;
  float* dD = dS + dk * Slice;
  T* gs = reinterpret_cast<T*>(dD + kC * Slice);  // Staged only
  T* qs = gs + kC * dk;
  T* ks = qs + kC * dk;
  const int64_t begin = s.cu_seqlens[seq], end = s.cu_seqlens[seq + 1];
  const int64_t state = (seq * H + h) * dk * dv;
  load_slice<Slice>(dht ? dht + state : nullptr, dk, dv, j0, dS);
  __syncthreads();
  const int64_t chunks = (end - begin + kC - 1) / kC;
  for (int64_t n = chunks - 1; n >= 0; --n) {
    const int64_t first = begin + n * kC;
    const Chunk c{first, end - first < kC ? end - first : kC, seq, first_slot(s, seq) + n};
    const int64_t at = c.slot * H + h;
    Rows<T> g_rows = rows_of(g, s, c, h, dk), q_rows = rows_of(q, s, c, h, dk), k_rows = rows_of(k, s, c, h, dk);
    if constexpr (Staged) {
      start_copy(gs, dk, g_rows.first, g_rows.stride, c.len, dk);
      start_copy(qs, dk, q_rows.first, q_rows.stride, c.len, dk);
      start_copy(ks, dk, k_rows.first, k_rows.stride, c.len, dk);
      g_rows = {gs, dk}, q_rows = {qs, dk}, k_rows = {ks, dk};
    }
    start_copy(W, dk, w.W + at * w.ck, dk, c.len, dk);
    start_copy(P, kC, w.P + at * w.cc, kC, c.len, kC);
    for (int64_t e = threadIdx.x; e < c.len * Slice; e += blockDim.x) {
      const int64_t r = e / Slice, jj = e % Slice;
      dos[e] = j0 + jj < dv ? to_f32(dout[((c.first + r) * H + h) * dv + j0 + jj]) : 0.f;
    }
    store_slice<Slice>(dS, dk, dv, j0, w.dS + at * w.kv, /*transposed=*/true);
    if constexpr (Staged) finish_copies<2>();  // g, q and k; W and P may still be on their way
    decayed_keys<T>(dk, q_rows, k_rows, g_rows, c.len, kd, kld, qg, elast);
    finish_copies();
    const Lane lane;
    const int64_t j = j0 + lane.jj;
    auto dout_at = [&](int64_t r) { return dos[r * Slice + lane.jj]; };
    // dD = scale P^T dO + Kd dS, a lane's columns col = lane.nth(n) (past len: not kept).
    {
      float acc[Lane::kRows] = {};
      if (j < dv) {
        for (int64_t r = 0; r < c.len; ++r) {
          const float o = dout_at(r);
#pragma unroll
          for (int n = 0; n < Lane::kRows; ++n)
            if (lane.nth(n) <= r) acc[n] += P[r * kC + lane.nth(n)] * o;
        }
#pragma unroll
        for (int n = 0; n < Lane::kRows; ++n) acc[n] *= s.scale;
        for (int64_t i = 0; i < dk; ++i) {
          const float ds = dS[i * Slice + lane.jj];
#pragma unroll
          for (int n = 0; n < Lane::kRows; ++n) acc[n] += kd[min(lane.nth(n), c.len - 1) * kld + i] * ds;
        }
      }
      lane.store_rows(acc, c.len, j, dv, w.dD + at * w.cv, dD);
    }
    __syncthreads();
    // dS_0 = Gamma_last dS + scale Qg^T dO - W^T dD, a lane's channels i = lane.nth(n).
    if (j < dv) {
      float through_q[Lane::kChannels] = {}, through_w[Lane::kChannels] = {};
      for (int64_t r = 0; r < c.len; ++r) {
        const float o = dout_at(r), d = dD[r * Slice + lane.jj];
#pragma unroll
        for (int n = 0; n < Lane::kChannels; ++n) {
          const int64_t i = min(lane.nth(n), dk - 1);
          through_q[n] += qg[r * dk + i] * o;
          through_w[n] += W[r * dk + i] * d;
        }
      }
#pragma unroll
      for (int n = 0; n < Lane::kChannels; ++n) {
        const int64_t i = lane.nth(n);
        if (i < dk) dS[i * Slice + lane.jj] = elast[i] * dS[i * Slice + lane.jj] + s.scale * through_q[n] - through_w[n];
      }
    }
    __syncthreads();
  }
  if (dh0) store_slice<Slice>(dS, dk, dv, j0, dh0 + state, false);
}

// state_grads_kernel on the tensor cores (Engine::tf32, slices of 16 or 32 columns): per
// chunk, in reverse, dD = scale P^T dO + Kd dS and dS_0 = Gamma_last dS + scale Qg^T dO - W^T
// dD by block_mma, from prepare_tf32_kernel's tiles (W, P, Kd, Qg, El; every row written,
// zero past len) instead of forming the decayed keys and queries in each slice's block.
// Shared: dS [d_k, Slice], dD and dO [C, Slice] (fp32; dO zero past len), W, Kd and Qg
// [C, d_k] (rows d_k + 4 apart), P [C, C], El [d_k], and dO's rows as T [C, Slice]. One
// buffer: two would not fit beside these at d_k = 128.
template <typename T, int Slice>
__global__ void __launch_bounds__(kThreads) state_grads_tf32_kernel(KdaArgs s, Tiles w, const T* dout,
                                                                    const float* dht, float* dh0) {
  using block_mma::product;
  extern __shared__ float sm[];
  const int64_t h = blockIdx.y, seq = blockIdx.z, H = s.heads, dk = s.dk, dv = s.dv, j0 = blockIdx.x * Slice;
  const int64_t ld = dk + 4, cols = dv - j0 < Slice ? dv - j0 : Slice;
  float* dS = sm;
  float* dD = dS + dk * Slice;
  float* dos = dD + kC * Slice;
  float* W = dos + kC * Slice;
  float* Kd = W + kC * ld;
  float* Qg = Kd + kC * ld;
  float* P = Qg + kC * ld;
  float* El = P + kC * kC;
  T* dout_rows = reinterpret_cast<T*>(El + dk);
  const int64_t begin = s.cu_seqlens[seq], end = s.cu_seqlens[seq + 1];
  const int64_t state = (seq * H + h) * dk * dv;
  load_slice<Slice>(dht ? dht + state : nullptr, dk, dv, j0, dS);
  for (int64_t n = (end - begin + kC - 1) / kC - 1; n >= 0; --n) {
    const int64_t first = begin + n * kC, len = end - first < kC ? end - first : kC;
    const int64_t at = (first_slot(s, seq) + n) * H + h;
    start_copy(W, ld, w.W + at * w.ck, dk, kC, dk);
    start_copy(Kd, ld, w.Kd + at * w.ck, dk, kC, dk);
    start_copy(Qg, ld, w.Qg + at * w.ck, dk, kC, dk);
    start_copy(P, kC, w.P + at * w.cc, kC, kC, kC);
    start_copy(El, dk, w.El + at * dk, dk, 1, dk);
    start_copy(dout_rows, Slice, dout + (first * H + h) * dv + j0, H * dv, len, cols);
    store_slice<Slice>(dS, dk, dv, j0, w.dS + at * w.kv, /*transposed=*/true);
    finish_copies();
    for (int64_t e = threadIdx.x; e < kC * Slice; e += blockDim.x)
      dos[e] = e / Slice < len && e % Slice < cols ? to_f32(dout_rows[e]) : 0.f;
    __syncthreads();
    product<Engine::tf32, Layout::transposed, Layout::rows>(kC, Slice, kC, s.scale, P, kC, dos, Slice, 0.f, dD, Slice);
    __syncthreads();  // each warp reads back the dD tiles it stored
    product<Engine::tf32, Layout::rows, Layout::rows>(kC, Slice, dk, 1.f, Kd, ld, dS, Slice, 1.f, dD, Slice);
    __syncthreads();
    for (int64_t e = threadIdx.x; e < kC * Slice; e += blockDim.x)
      if (e % Slice < cols) w.dD[at * w.cv + e / Slice * dv + j0 + e % Slice] = dD[e];
    for (int64_t e = threadIdx.x; e < dk * Slice; e += blockDim.x) dS[e] *= El[e / Slice];
    __syncthreads();
    product<Engine::tf32, Layout::transposed, Layout::rows>(dk, Slice, kC, s.scale, Qg, ld, dos, Slice, 1.f, dS, Slice);
    __syncthreads();
    product<Engine::tf32, Layout::transposed, Layout::rows>(dk, Slice, kC, -1.f, W, ld, dD, Slice, 1.f, dS, Slice);
    __syncthreads();
  }
  if (dh0) store_slice<Slice>(dS, dk, dv, j0, dh0 + state, false);
}

}  // namespace

template <typename T>
void state_grads_launch(const ExecContext& ctx, const KdaArgs& a, const Tiles& w, const T* q, const T* k, const T* g,
                        const T* dout, const float* dht, float* dh0, int slice, const char* op) {
  by_slice(slice, [&]<int Slice>() {
    const dim3 grid = documents_grid<Slice>(a);
    const size_t tc =
        floats(a.dk * Slice + 2 * kC * Slice + 3 * kC * (a.dk + 4) + kC * kC + a.dk) + kC * Slice * sizeof(T);
    if constexpr (Slice >= 16 && std::is_same_v<T, bf16>)
      if (sequential_on_tensor_cores<T>(a, tc, op)) {
        allow_shared(state_grads_tf32_kernel<T, Slice>, tc, op);
        state_grads_tf32_kernel<T, Slice><<<grid, kThreads, tc, stream(ctx)>>>(a, w, dout, dht, dh0);
        check_launch(op, "state_grads_tf32_kernel");
        return;
      }
    const size_t sg = floats(2 * kC * a.dk + kC * padded_ld(a.dk) + kC * kC + kC * Slice + a.dk + a.dk * Slice +
                             kC * Slice);
    const size_t staged = sg + 3 * kC * a.dk * sizeof(T);
    const auto launch = [&]<bool Staged>(size_t bytes) {
      allow_shared(state_grads_kernel<T, Slice, Staged>, bytes, op);
      state_grads_kernel<T, Slice, Staged><<<grid, kThreads, bytes, stream(ctx)>>>(a, w, q, k, g, dout, dht, dh0);
    };
    if (staged <= shared_limit(op))
      launch.template operator()<true>(staged);
    else
      launch.template operator()<false>(sg);
    check_launch(op, "state_grads_kernel");
  });
}

template void state_grads_launch<float>(const ExecContext&, const KdaArgs&, const Tiles&, const float*, const float*,
                                        const float*, const float*, const float*, float*, int, const char*);
template void state_grads_launch<bf16>(const ExecContext&, const KdaArgs&, const Tiles&, const bf16*, const bf16*,
                                       const bf16*, const bf16*, const float*, float*, int, const char*);

}  // namespace kiln::cuda::kda_chunked

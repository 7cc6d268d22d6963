// Chunked KDA: the states kernels (per document, chunks in order: S_0 of each chunk, D and
// the carried state; the overview is kda_chunked_common.cuh's), in fp32 SIMT (states_kernel)
// and on the tensor cores (states_tf32_kernel), and factors_and_states: prepare, then them.
#include "ops/kda/kda_chunked_common.cuh"

namespace kiln::cuda::kda_chunked {

namespace {

// One block per (d_v slice, head, document). Shared: the chunk's W [C, d_k] (rows padded_ld
// apart; copied in while its Kd is computed: read from global memory, its loads were the
// kernel's critical path), Kd [C, d_k], elast [d_k], S [d_k, Slice], D [C, Slice]; with
// Staged (where the card has the room) the chunk's g and k rows too, T [C, d_k] each, copied
// in while the state is stored: read from global memory element by element, a chunk's
// decayed keys waited on a chain of loads. S_0 is stored [d_k, d_v], or [d_v, d_k] with
// `transposed` (the backward's).
template <typename T, int Slice, bool Staged>
__global__ void __launch_bounds__(kThreads) states_kernel(KdaArgs s, Tiles w, const T* k, const T* g,
                                                          const float* h0, float* ht, bool transposed) {
  using Lane = SliceLane<Slice>;
  extern __shared__ float sm[];
  const int64_t h = blockIdx.y, seq = blockIdx.z, H = s.heads, dk = s.dk, dv = s.dv, j0 = blockIdx.x * Slice;
  const int64_t wld = padded_ld(dk);
  float* W = sm;
  float* kd = W + kC * wld;
  float* elast = kd + kC * dk;
  float* S = elast + dk;
  float* D = S + dk * Slice;
  T* gs = reinterpret_cast<T*>(D + kC * Slice);  // Staged only
  T* ks = gs + kC * dk;
  const int64_t begin = s.cu_seqlens[seq], end = s.cu_seqlens[seq + 1];
  const int64_t state = (seq * H + h) * dk * dv;
  load_slice<Slice>(h0 ? h0 + state : nullptr, dk, dv, j0, S);
  __syncthreads();
  for (int64_t first = begin, n = 0; first < end; first += kC, ++n) {
    const Chunk c{first, end - first < kC ? end - first : kC, seq, first_slot(s, seq) + n};
    const int64_t at = c.slot * H + h;
    Rows<T> g_rows = rows_of(g, s, c, h, dk), k_rows = rows_of(k, s, c, h, dk);
    if constexpr (Staged) {
      start_copy(gs, dk, g_rows.first, g_rows.stride, c.len, dk);
      start_copy(ks, dk, k_rows.first, k_rows.stride, c.len, dk);
      g_rows = {gs, dk}, k_rows = {ks, dk};
    }
    start_copy(W, wld, w.W + at * w.ck, dk, c.len, dk);
    store_slice<Slice>(S, dk, dv, j0, w.S0 + at * w.kv, transposed);
    if constexpr (Staged) finish_copies<1>();  // g and k; W may still be on its way
    decayed_keys<T>(dk, Rows<T>{}, k_rows, g_rows, c.len, kd, dk, nullptr, elast);
    finish_copies();
    const Lane lane;
    const int64_t j = j0 + lane.jj;
    // D = U - W S_0 (rows past len are computed from the last row and not kept).
    {
      float acc[Lane::kRows];
#pragma unroll
      for (int n = 0; n < Lane::kRows; ++n)
        acc[n] = j < dv ? w.U[at * w.cv + min(lane.nth(n), c.len - 1) * dv + j] : 0.f;
      if (j < dv)
        for (int64_t i = 0; i < dk; ++i) {
          const float si = S[i * Slice + lane.jj];
#pragma unroll
          for (int n = 0; n < Lane::kRows; ++n) acc[n] -= W[min(lane.nth(n), c.len - 1) * wld + i] * si;
        }
      lane.store_rows(acc, c.len, j, dv, w.D + at * w.cv, D);
    }
    __syncthreads();
    // S_L = Gamma_last S_0 + Kd^T D (channels past d_k likewise).
    {
      float acc[Lane::kChannels];
#pragma unroll
      for (int n = 0; n < Lane::kChannels; ++n) {
        const int64_t i = min(lane.nth(n), dk - 1);
        acc[n] = elast[i] * S[i * Slice + lane.jj];
      }
      for (int64_t r = 0; r < c.len; ++r) {
        const float d = D[r * Slice + lane.jj];
#pragma unroll
        for (int n = 0; n < Lane::kChannels; ++n) acc[n] += kd[r * dk + min(lane.nth(n), dk - 1)] * d;
      }
      __syncthreads();  // a clamped channel read S rows another thread now writes
#pragma unroll
      for (int n = 0; n < Lane::kChannels; ++n)
        if (lane.nth(n) < dk) S[lane.nth(n) * Slice + lane.jj] = acc[n];
    }
    __syncthreads();
  }
  if (ht) store_slice<Slice>(S, dk, dv, j0, ht + state, false);
}

// states_kernel on the tensor cores (Engine::tf32, slices of 16 or 32 columns): per chunk
// D = U - W S_0 and S_L = Gamma_last S_0 + Kd^T D by block_mma, from prepare_tf32_kernel's
// tiles (W, U, Kd, El: every row written, zero past len, so D's rows past len are zero and
// nothing stale is summed). The next chunk's tiles are copied by cp.async into the other of
// two buffers while this chunk is computed: a chunk no longer waits on its loads or forms its
// decayed keys in each slice's block. Shared: S [d_k, Slice], then two buffers of W and Kd
// [C, d_k] (rows d_k + 4 apart: fewer bank conflicts for wmma), U's slice [C, Slice] (D in
// place) and El [d_k].
template <int Slice>
__global__ void __launch_bounds__(kThreads) states_tf32_kernel(KdaArgs s, Tiles w, const float* h0, float* ht,
                                                               bool transposed) {
  using block_mma::product;
  extern __shared__ float sm[];
  const int64_t h = blockIdx.y, seq = blockIdx.z, H = s.heads, dk = s.dk, dv = s.dv, j0 = blockIdx.x * Slice;
  const int64_t ld = dk + 4, buffer = 2 * kC * ld + kC * Slice + dk;
  const int64_t cols = dv - j0 < Slice ? dv - j0 : Slice;  // U's columns in this slice
  float* S = sm;
  float* buffers = S + dk * Slice;
  const int64_t begin = s.cu_seqlens[seq], end = s.cu_seqlens[seq + 1], slot0 = first_slot(s, seq);
  const int64_t chunks = (end - begin + kC - 1) / kC, state = (seq * H + h) * dk * dv;
  if (cols < Slice)  // the columns past d_v stay zero in both buffers' U
    for (int64_t e = threadIdx.x; e < 2 * kC * Slice; e += blockDim.x)
      buffers[e / (kC * Slice) * buffer + 2 * kC * ld + e % (kC * Slice)] = 0.f;
  load_slice<Slice>(h0 ? h0 + state : nullptr, dk, dv, j0, S);
  // Four copies (four cp.async groups) per chunk.
  const auto fetch = [&](int64_t n) {
    float* b = buffers + n % 2 * buffer;
    const int64_t at = (slot0 + n) * H + h;
    start_copy(b, ld, w.W + at * w.ck, dk, kC, dk);
    start_copy(b + kC * ld, ld, w.Kd + at * w.ck, dk, kC, dk);
    start_copy(b + 2 * kC * ld, Slice, w.U + at * w.cv + j0, dv, kC, cols);
    start_copy(b + 2 * kC * ld + kC * Slice, dk, w.El + at * dk, dk, 1, dk);
  };
  if (chunks > 0) fetch(0);
  for (int64_t n = 0; n < chunks; ++n) {
    const int64_t at = (slot0 + n) * H + h;
    if (n + 1 < chunks) fetch(n + 1);  // into the buffer chunk n - 1 used, read before its last sync
    store_slice<Slice>(S, dk, dv, j0, w.S0 + at * w.kv, transposed);
    if (n + 1 < chunks)
      finish_copies<4>();  // chunk n's four; n + 1's may still be on their way
    else
      finish_copies();
    const float* W = buffers + n % 2 * buffer;
    const float* Kd = W + kC * ld;
    float* D = buffers + n % 2 * buffer + 2 * kC * ld;
    const float* El = D + kC * Slice;
    product<Engine::tf32, Layout::rows, Layout::rows>(kC, Slice, dk, -1.f, W, ld, S, Slice, 1.f, D, Slice);
    __syncthreads();
    for (int64_t e = threadIdx.x; e < kC * Slice; e += blockDim.x)
      if (e % Slice < cols) w.D[at * w.cv + e / Slice * dv + j0 + e % Slice] = D[e];
    for (int64_t e = threadIdx.x; e < dk * Slice; e += blockDim.x) S[e] *= El[e / Slice];
    __syncthreads();
    product<Engine::tf32, Layout::transposed, Layout::rows>(dk, Slice, kC, 1.f, Kd, ld, D, Slice, 1.f, S, Slice);
    __syncthreads();
  }
  if (ht) store_slice<Slice>(S, dk, dv, j0, ht + state, false);
}

}  // namespace

template <typename T>
void factors_and_states(const ExecContext& ctx, const KdaArgs& a, const Tiles& w, const T* q, const T* k, const T* v,
                        const T* g, const T* beta, const float* h0, float* ht, bool transposed, bool query_tiles,
                        int slice, const char* op) {
  prepare_launch<T>(ctx, a, w, q, k, v, g, beta, query_tiles, op);
  by_slice(slice, [&]<int Slice>() {
    const dim3 grid = documents_grid<Slice>(a);
    const size_t tc = floats(a.dk * Slice + 2 * (2 * kC * (a.dk + 4) + kC * Slice + a.dk));
    if constexpr (Slice >= 16)
      if (sequential_on_tensor_cores<T>(a, tc, op)) {
        allow_shared(states_tf32_kernel<Slice>, tc, op);
        states_tf32_kernel<Slice><<<grid, kThreads, tc, stream(ctx)>>>(a, w, h0, ht, transposed);
        check_launch(op, "states_tf32_kernel");
        return;
      }
    const size_t st = floats(kC * padded_ld(a.dk) + kC * a.dk + a.dk + a.dk * Slice + kC * Slice);
    const size_t staged = st + 2 * kC * a.dk * sizeof(T);
    const auto launch = [&]<bool Staged>(size_t bytes) {
      allow_shared(states_kernel<T, Slice, Staged>, bytes, op);
      states_kernel<T, Slice, Staged><<<grid, kThreads, bytes, stream(ctx)>>>(a, w, k, g, h0, ht, transposed);
    };
    if (staged <= shared_limit(op))
      launch.template operator()<true>(staged);
    else
      launch.template operator()<false>(st);
    check_launch(op, "states_kernel");
  });
}

template void factors_and_states<float>(const ExecContext&, const KdaArgs&, const Tiles&, const float*, const float*,
                                        const float*, const float*, const float*, const float*, float*, bool, bool,
                                        int, const char*);
template void factors_and_states<bf16>(const ExecContext&, const KdaArgs&, const Tiles&, const bf16*, const bf16*,
                                       const bf16*, const bf16*, const bf16*, const float*, float*, bool, bool,
                                       int, const char*);

}  // namespace kiln::cuda::kda_chunked

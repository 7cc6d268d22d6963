// Chunked KDA: the grads kernels (per chunk: dq, dk, dv, dg, dbeta; the overview is
// kda_chunked_common.cuh's), in fp32 SIMT (grads_kernel) and with their products on the
// tensor cores (grads_tf32_kernel), and the backward: factors_and_states, state_grads, then
// grads.
#include "ops/kda/kda_chunked_common.cuh"
#include "ops/kda/kda_chunked_pairwise.cuh"

namespace kiln::cuda {

namespace kda_chunked {

namespace {

// grads' last steps, the same in both kernels. dbeta_r = db_r + sum_{s<r} dL_rs A_rs (dL in
// pm, A the workspace's tile), a thread per row.
template <typename T>
__device__ void store_dbeta(const Chunk& c, int64_t h, int64_t H, const float* pm, const float* A, const float* db,
                            T* dbeta) {
  for (int64_t r = threadIdx.x; r < c.len; r += blockDim.x) {
    float acc = db[r];
    for (int64_t col = 0; col < r; ++col) acc += pm[r * kC + col] * A[r * kC + col];
    from_f32(acc, dbeta + (c.first + r) * H + h);
  }
}

// dg = the reversed cumulative sum of dG (gc), a thread per channel; dq, dk out.
template <typename T>
__device__ void store_dg_dq_dk(const Chunk& c, int64_t h, int64_t H, int64_t dk, const float* gq, const float* gk,
                               const float* gc, T* dg, T* dq_out, T* dk_out) {
  const auto krow = [&](int64_t r) { return ((c.first + r) * H + h) * dk; };
  for (int64_t i = threadIdx.x; i < dk; i += blockDim.x) {
    float acc = 0.f;
    for (int64_t r = c.len - 1; r >= 0; --r) {
      acc += gc[r * dk + i];
      from_f32(acc, dg + krow(r) + i);
    }
  }
  for (int64_t e = threadIdx.x; e < c.len * dk; e += blockDim.x) {
    const int64_t r = e / dk, i = e % dk;
    from_f32(gq[e], dq_out + krow(r) + i);
    from_f32(gk[e], dk_out + krow(r) + i);
  }
}

// How much of its inputs grads_kernel copies into shared memory: what the card has room for.
enum class GradsStaging {
  none,     // 148 KiB at d_k = d_v = 128 (below), inside an A100's 163 KiB
  inputs,   // + the chunk's k and q rows, T [C, d_k] each
  outputs,  // + its dO rows, T [C, d_v], and D, f32 [C, d_v]: 224.5 KiB in bf16 at 128, inside
            //   Hopper's 227 KiB
};

// One block per (chunk, head). Shared: cum, gq, gk, gc (dG) [C, d_k], a pair matrix [C, C]
// (dP, then dL), beta [C] and dbeta [C], and what `staging` adds: the pairwise loops read
// every k and q row len times, the dP pairs and the S_0 / dS products every dO and D row as
// often, from shared memory then rather than through the caches (those loads' latency was
// the kernel's time: it is all fp32 SIMT arithmetic).
template <typename T, GradsStaging staging>
__global__ void __launch_bounds__(kGradsThreads) grads_kernel(KdaArgs s, Tiles w, const T* q, const T* k, const T* v,
                                                         const T* g, const T* beta, const T* dout, T* dq_out,
                                                         T* dk_out, T* dv_out, T* dg, T* dbeta) {
  extern __shared__ float sm[];
  Chunk c;
  if (!locate(s, blockIdx.x, c)) return;
  const int64_t h = blockIdx.y, H = s.heads, dk = s.dk, dv = s.dv, len = c.len, last = len - 1;
  const int64_t at = c.slot * H + h;
  const float scale = s.scale;
  float* cum = sm;
  float* gq = cum + kC * dk;
  float* gk = gq + kC * dk;
  float* gc = gk + kC * dk;
  float* pm = gc + kC * dk;
  float* bt = pm + kC * kC;
  float* db = bt + kC;
  constexpr bool inputs = staging != GradsStaging::none, outputs = staging == GradsStaging::outputs;
  T* ks = reinterpret_cast<T*>(db + kC);  // inputs and outputs only
  T* qs = ks + kC * dk;
  T* dos = qs + kC * dk;  // outputs only
  float* Ds = reinterpret_cast<float*>(dos + kC * dv);
  auto vrow = [&](int64_t r) { return ((c.first + r) * H + h) * dv; };
  const auto [S0, dS, D, dD, M, dW, Xk, Xv, Tl] = grad_tiles(w, at);
  // The chunk's k and q rows (key(r, i), query(r, i)): staged in shared memory, or read from
  // global memory.
  Rows<T> key = rows_of(k, s, c, h, dk), query = rows_of(q, s, c, h, dk);
  if constexpr (inputs) {
    start_copy(ks, dk, key.first, key.stride, len, dk);
    start_copy(qs, dk, query.first, query.stride, len, dk);
    key = {ks, dk}, query = {qs, dk};
  }
  if constexpr (outputs) {
    start_copy(dos, dv, dout + vrow(0), H * dv, len, dv);
    start_copy(Ds, dv, D, dv, len, dv);
  }
  const auto out_grad = [&](int64_t r, int64_t j) {
    if constexpr (outputs)
      return to_f32(dos[r * dv + j]);
    else
      return to_f32(dout[vrow(r) + j]);
  };
  const auto delta = [&](int64_t r, int64_t j) {
    if constexpr (outputs)
      return Ds[r * dv + j];
    else
      return D[r * dv + j];
  };

  cumulative_decay(dk, rows_of(g, s, c, h, dk), len, cum, dk);
  for (int64_t e = threadIdx.x; e < kC * dk; e += blockDim.x) gq[e] = gk[e] = gc[e] = 0.f;
  for (int64_t r = threadIdx.x; r < kC; r += blockDim.x) bt[r] = r < len ? to_f32(beta[(c.first + r) * H + h]) : 0.f;
  if constexpr (inputs) finish_copies();
  // dP_rs = scale dO_r . D_s (s <= r), a warp per pair.
  const WarpPairs pairs;
  for (int64_t e = pairs.first; e < kC * kC; e += pairs.step) {
    const int64_t r = e / kC, col = e % kC;
    float acc = 0.f;
    if (r < len && col <= r) {
      for (int64_t j = pairs.lane; j < dv; j += 32) acc += out_grad(r, j) * delta(col, j);
      acc = warp_sum(acc);
    }
    if (pairs.lane == 0) pm[e] = scale * acc;
  }
  __syncthreads();
  // P's pairwise terms (with the diagonal), a thread per channel.
  const auto unit = [](int64_t) { return 1.f; };
  pairwise_gradient(len, dk, cum, pm, true, query, key, unit, gq, gk, gc);
  __syncthreads();
  // Per element (r, i): Qg's gradient through S_0, Kd's through dS, and dW = -dD S_0^T. A
  // thread keeps channel i and takes kRows rows at a time, so each S_0 and dS value it
  // loads serves kRows rows (read once per row, they were the kernel's largest traffic).
  {
    constexpr int kRows = 4;
    const int64_t groups = blockDim.x / dk, i = threadIdx.x % dk, group = threadIdx.x / dk;
    for (int64_t r0 = group * kRows; group < groups && r0 < len; r0 += groups * kRows) {
      float sdo[kRows] = {}, sdd[kRows] = {}, skd[kRows] = {};
      int64_t rows[kRows];
#pragma unroll
      for (int n = 0; n < kRows; ++n) rows[n] = r0 + n < len ? r0 + n : len - 1;  // past len: computed, not kept
      for (int64_t j = 0; j < dv; ++j) {
        const float s0 = S0[j * dk + i], ds = dS[j * dk + i];
#pragma unroll
        for (int n = 0; n < kRows; ++n) {
          sdo[n] += s0 * out_grad(rows[n], j);
          sdd[n] += s0 * dD[rows[n] * dv + j];
          skd[n] += ds * delta(rows[n], j);
        }
      }
#pragma unroll
      for (int n = 0; n < kRows; ++n) {
        const int64_t r = r0 + n, e = r * dk + i;
        if (r >= len) break;
        const float er = expf(cum[e]), qi = query(r, i);
        gq[e] += scale * er * sdo[n];
        gc[e] += scale * qi * er * sdo[n];
        dW[e] = -sdd[n];
        const float el = expf(cum[last * dk + i] - cum[e]);
        gk[e] += el * skd[n];
        const float t = r == last ? 0.f : key(r, i) * el * skd[n];
        Tl[e] = t;
        gc[e] -= t;
      }
    }
  }
  __syncthreads();
  // dG_last: the Kd terms' shares and S_0's decay.
  for (int64_t i = threadIdx.x; i < dk; i += blockDim.x) {
    float acc = 0.f, decay = 0.f;
    for (int64_t r = 0; r < last; ++r) acc += Tl[r * dk + i];
    for (int64_t j = 0; j < dv; ++j) decay += S0[j * dk + i] * dS[j * dk + i];
    gc[last * dk + i] += acc + expf(cum[last * dk + i]) * decay;
  }
  __syncthreads();
  // X_v = M^T dD (and dv = beta X_v), X_k = M^T dW with its terms of dk and dG.
  for (int64_t e = threadIdx.x; e < len * dv; e += blockDim.x) {
    const int64_t col = e / dv, j = e % dv;
    float acc = 0.f;
    for (int64_t r = col; r < len; ++r) acc += M[r * kC + col] * dD[r * dv + j];
    Xv[e] = acc;
    from_f32(bt[col] * acc, dv_out + vrow(col) + j);
  }
  for (int64_t e = threadIdx.x; e < len * dk; e += blockDim.x) {
    const int64_t col = e / dk, i = e % dk;
    float acc = 0.f;
    for (int64_t r = col; r < len; ++r) acc += M[r * kC + col] * dW[r * dk + i];
    Xk[e] = acc;
    const float ec = expf(cum[e]);
    gk[e] += bt[col] * ec * acc;
    gc[e] += bt[col] * key(col, i) * ec * acc;
  }
  __syncthreads();
  // dbeta_c = v_c . X_v[c] + Kg_c . X_k[c]; dL_rs = -(X_v[r] . U[s] + X_k[r] . W[s]) (s < r).
  const float* U = w.U + at * w.cv;
  const float* W = w.W + at * w.ck;
  for (int64_t col = threadIdx.x; col < len; col += blockDim.x) {
    float acc = 0.f;
    for (int64_t j = 0; j < dv; ++j) acc += to_f32(v[vrow(col) + j]) * Xv[col * dv + j];
    for (int64_t i = 0; i < dk; ++i) acc += key(col, i) * expf(cum[col * dk + i]) * Xk[col * dk + i];
    db[col] = acc;
  }
  for (int64_t e = pairs.first; e < kC * kC; e += pairs.step) {
    const int64_t r = e / kC, col = e % kC;
    float acc = 0.f;
    if (r < len && col < r) {
      for (int64_t j = pairs.lane; j < dv; j += 32) acc += Xv[r * dv + j] * U[col * dv + j];
      for (int64_t i = pairs.lane; i < dk; i += 32) acc += Xk[r * dk + i] * W[col * dk + i];
      acc = warp_sum(acc);
    }
    if (pairs.lane == 0) pm[e] = -acc;
  }
  __syncthreads();
  // dbeta_r += sum_{s<r} dL_rs A_rs; A's pairwise terms with dA_rs = beta_r dL_rs.
  store_dbeta(c, h, H, pm, w.A + at * w.cc, db, dbeta);
  const auto beta_of = [&](int64_t r) { return bt[r]; };
  pairwise_gradient(len, dk, cum, pm, false, key, key, beta_of, gk, gk, gc);
  __syncthreads();
  store_dg_dq_dk(c, h, H, dk, gq, gk, gc, dg, dq_out, dk_out);
}

// grads_kernel with its plain matrix products on the tensor cores (block_mma, Engine::tf32;
// bf16 inputs with d_k, d_v multiples of 16): dP = scale dO D^T, Qg's gradient through S_0
// (dO S_0), Kd's through dS (D dS), dW = -dD S_0 (into the workspace), X_v = M^T dD, X_k =
// M^T dW and dL = -(X_v U^T + X_k W^T); with PairwiseTc the two pairwise gradients' sums off
// the 16 x 16 diagonal blocks too (pairwise_gradient_tf32). The elementwise terms around
// them, dbeta's row dots and the diagonal blocks' pairwise terms (all of them without
// PairwiseTc) as in grads_kernel.
// Shared: cum, gq, gk [C, d_k]; gc [C, d_k], whose room holds dO first, fp32 [C, d_v + 4]
// (zero past len: wmma takes fp32, and it is only the products' operand); a pair matrix
// [C, C] (dP, then dL), beta [C], dbeta [C]; with PairwiseTc the pairwise sums' staging
// (kPairStage floats, 40.5 KiB); with StagedInputs the chunk's k and q rows, T [C, d_k] each,
// as in grads_kernel. The other operands are read by wmma from the workspace:
// D, dD (zero past len), M (zero past len) and S_0, dS whole; X_v, X_k and dW are written
// for all C rows (zero past len, so X_k's sum over dW's rows reads no stale value). U's and
// W's stale rows past len reach only dL's columns past len, which are zeroed.
template <typename T, bool StagedInputs, bool PairwiseTc>
__global__ void __launch_bounds__(kGradsThreads)
    grads_tf32_kernel(KdaArgs s, Tiles w, const T* q, const T* k, const T* v, const T* g, const T* beta,
                      const T* dout, T* dq_out, T* dk_out, T* dv_out, T* dg, T* dbeta) {
  using block_mma::product;
  constexpr Engine E = Engine::tf32;
  extern __shared__ float sm[];
  Chunk c;
  if (!locate(s, blockIdx.x, c)) return;
  const int64_t h = blockIdx.y, H = s.heads, dk = s.dk, dv = s.dv, len = c.len, last = len - 1;
  const int64_t at = c.slot * H + h, dold = dv + 4;
  const float scale = s.scale;
  float* cum = sm;
  float* gq = cum + kC * dk;
  float* gk = gq + kC * dk;
  float* gc = gk + kC * dk;
  float* dos = gc;  // until the products are done
  float* pm = gc + kC * (dk > dold ? dk : dold);
  float* bt = pm + kC * kC;
  float* db = bt + kC;
  float* stage = db + kC;  // PairwiseTc only
  T* ks = reinterpret_cast<T*>(stage + (PairwiseTc ? kPairStage : 0));  // StagedInputs only
  T* qs = ks + kC * dk;
  auto krow = [&](int64_t r) { return ((c.first + r) * H + h) * dk; };
  auto vrow = [&](int64_t r) { return ((c.first + r) * H + h) * dv; };
  if constexpr (StagedInputs) {
    start_copy(ks, dk, k + krow(0), H * dk, len, dk);
    start_copy(qs, dk, q + krow(0), H * dk, len, dk);
  }
  const auto key = [&](int64_t r, int64_t i) {
    if constexpr (StagedInputs)
      return to_f32(ks[r * dk + i]);
    else
      return to_f32(k[krow(r) + i]);
  };
  const auto query = [&](int64_t r, int64_t i) {
    if constexpr (StagedInputs)
      return to_f32(qs[r * dk + i]);
    else
      return to_f32(q[krow(r) + i]);
  };
  const auto [S0, dS, D, dD, M, dW, Xk, Xv, Tl] = grad_tiles(w, at);

  cumulative_decay(dk, rows_of(g, s, c, h, dk), len, cum, dk);
  for (int64_t r = threadIdx.x; r < kC; r += blockDim.x) bt[r] = r < len ? to_f32(beta[(c.first + r) * H + h]) : 0.f;
  for (int64_t e = threadIdx.x; e < kC * dv; e += blockDim.x) {
    const int64_t r = e / dv, j = e % dv;
    dos[r * dold + j] = r < len ? to_f32(dout[vrow(r) + j]) : 0.f;
  }
  __syncthreads();
  // The products of the workspace's tiles and dO (independent: no barrier between them).
  // gq and gk take dO S_0 and D dS raw; the epilogue below scales them in place.
  product<E, Layout::rows, Layout::transposed>(kC, kC, dv, scale, dos, dold, D, dv, 0.f, pm, kC);
  product<E, Layout::rows, Layout::rows>(kC, dk, dv, 1.f, dos, dold, S0, dk, 0.f, gq, dk);
  product<E, Layout::rows, Layout::rows>(kC, dk, dv, 1.f, D, dv, dS, dk, 0.f, gk, dk);
  product<E, Layout::rows, Layout::rows>(kC, dk, dv, -1.f, dD, dv, S0, dk, 0.f, dW, dk);
  product<E, Layout::transposed, Layout::rows>(kC, dv, kC, 1.f, M, kC, dD, dv, 0.f, Xv, dv);
  if constexpr (StagedInputs) __pipeline_wait_prior(0);
  __syncthreads();  // dO's room is gc's from here
  product<E, Layout::transposed, Layout::rows>(kC, dk, kC, 1.f, M, kC, dW, dk, 0.f, Xk, dk);
  // Per element (r, i): Qg's gradient through S_0 (sdo), Kd's through dS (skd); gc starts
  // here. The same thread per element as pairwise_gradient's and the X_k loop's below.
  for (int64_t e = threadIdx.x; e < len * dk; e += blockDim.x) {
    const int64_t r = e / dk, i = e % dk;
    const float sdo = gq[e], skd = gk[e];
    const float er = expf(cum[e]), el = expf(cum[last * dk + i] - cum[e]);
    gq[e] = scale * er * sdo;
    gk[e] = el * skd;
    const float t = r == last ? 0.f : key(r, i) * el * skd;
    Tl[e] = t;
    gc[e] = scale * query(r, i) * er * sdo - t;
  }
  for (int64_t e = threadIdx.x; e < len * dv; e += blockDim.x)
    from_f32(bt[e / dv] * Xv[e], dv_out + vrow(e / dv) + e % dv);
  __syncthreads();
  // P's pairwise terms (with the diagonal), then X_k's terms of dk and dG: each thread its
  // own elements in both loops (pairwise_gradient's), or after pairwise_gradient_tf32's
  // closing barrier.
  const auto unit = [](int64_t) { return 1.f; };
  if constexpr (PairwiseTc)
    pairwise_gradient_tf32(len, dk, cum, pm, true, query, key, unit, gq, gk, gc, stage);
  else
    pairwise_gradient(len, dk, cum, pm, true, query, key, unit, gq, gk, gc);
  for (int64_t e = threadIdx.x; e < len * dk; e += blockDim.x) {
    const int64_t col = e / dk, i = e % dk;
    const float ec = expf(cum[e]), x = Xk[e];
    gk[e] += bt[col] * ec * x;
    gc[e] += bt[col] * key(col, i) * ec * x;
  }
  __syncthreads();
  // dG_last: the Kd terms' shares and S_0's decay.
  for (int64_t i = threadIdx.x; i < dk; i += blockDim.x) {
    float acc = 0.f, decay = 0.f;
    for (int64_t r = 0; r < last; ++r) acc += Tl[r * dk + i];
    for (int64_t j = 0; j < dv; ++j) decay += S0[j * dk + i] * dS[j * dk + i];
    gc[last * dk + i] += acc + expf(cum[last * dk + i]) * decay;
  }
  // dbeta_c = v_c . X_v[c] + Kg_c . X_k[c]; dL = -(X_v U^T + X_k W^T), kept for s < r.
  for (int64_t col = threadIdx.x; col < len; col += blockDim.x) {
    float acc = 0.f;
    for (int64_t j = 0; j < dv; ++j) acc += to_f32(v[vrow(col) + j]) * Xv[col * dv + j];
    for (int64_t i = 0; i < dk; ++i) acc += key(col, i) * expf(cum[col * dk + i]) * Xk[col * dk + i];
    db[col] = acc;
  }
  product<E, Layout::rows, Layout::transposed>(kC, kC, dv, -1.f, Xv, dv, w.U + at * w.cv, dv, 0.f, pm, kC);
  __syncthreads();  // each warp reads back the dL tiles it stored
  product<E, Layout::rows, Layout::transposed>(kC, kC, dk, -1.f, Xk, dk, w.W + at * w.ck, dk, 1.f, pm, kC);
  __syncthreads();
  for (int64_t e = threadIdx.x; e < kC * kC; e += blockDim.x)
    if (e / kC >= len || e % kC >= e / kC) pm[e] = 0.f;  // U's and W's stale rows land past len
  __syncthreads();
  // dbeta_r += sum_{s<r} dL_rs A_rs; A's pairwise terms with dA_rs = beta_r dL_rs.
  store_dbeta(c, h, H, pm, w.A + at * w.cc, db, dbeta);
  const auto beta_of = [&](int64_t r) { return bt[r]; };
  if constexpr (PairwiseTc)
    pairwise_gradient_tf32(len, dk, cum, pm, false, key, key, beta_of, gk, gk, gc, stage);  // ends synced
  else
    pairwise_gradient(len, dk, cum, pm, false, key, key, beta_of, gk, gk, gc);
  __syncthreads();
  store_dg_dq_dk(c, h, H, dk, gq, gk, gc, dg, dq_out, dk_out);
}

// grads_tf32_kernel where the engine is the tensor cores and its shared memory fits: with the
// pairwise sums on the tensor cores where their staging fits, and the chunk's k and q rows
// where they fit too (at d_k = d_v = 128: 145.5 + 40.5 + 32 = 218 KiB, inside Hopper's 227);
// false otherwise, for grads_kernel.
template <typename T>
bool backward_grads_tf32(const ExecContext& ctx, const KdaArgs& a, const Tiles& w, const T* q, const T* k,
                         const T* v, const T* g, const T* beta, const T* dout, T* dq, T* dk, T* dv, T* dg, T* dbeta,
                         const char* op) {
  if constexpr (std::is_same_v<T, bf16>) {
    if (engine_of<T>(a) != Engine::tf32) return false;
    const int64_t gc_room = kC * (a.dk > a.dv + 4 ? a.dk : a.dv + 4);  // gc, or dO in fp32 before it
    const size_t none = floats(3 * kC * a.dk + gc_room + kC * kC + 2 * kC);
    const size_t pairwise = none + floats(kPairStage), inputs = pairwise + 2 * kC * a.dk * sizeof(T);
    const size_t limit = shared_limit(op);
    const auto launch = [&]<bool StagedInputs, bool PairwiseTc>(size_t bytes) {
      allow_shared(grads_tf32_kernel<T, StagedInputs, PairwiseTc>, bytes, op);
      grads_tf32_kernel<T, StagedInputs, PairwiseTc><<<chunks_grid(a), kGradsThreads, bytes, stream(ctx)>>>(
          a, w, q, k, v, g, beta, dout, dq, dk, dv, dg, dbeta);
    };
    if (inputs <= limit)
      launch.template operator()<true, true>(inputs);
    else if (pairwise <= limit)
      launch.template operator()<false, true>(pairwise);
    else if (none <= limit)
      launch.template operator()<false, false>(none);
    else
      return false;
    check_launch(op, "grads_tf32_kernel");
    return true;
  }
  return false;
}

template <typename T>
void backward_launch(const ExecContext& ctx, const KdaArgs& a, const T* q, const T* k, const T* v, const T* g,
                     const T* beta, const float* h0, const T* dout, const float* dht, T* dq, T* dk, T* dv, T* dg,
                     T* dbeta, float* dh0, float* workspace) {
  const char* op = "kda_chunked_backward";
  const Tiles w = tiles_of(workspace, slots_of(a.tokens, a.num_seqs) * a.heads, a.dk, a.dv);
  const int slice = sequential_slice(a, engine_of<T>(a), op);
  factors_and_states<T>(ctx, a, w, q, k, v, g, beta, h0, nullptr, /*transposed=*/true, /*query_tiles=*/true, slice,
                        op);
  state_grads_launch<T>(ctx, a, w, q, k, g, dout, dht, dh0, slice, op);
  if (a.tokens == 0) return;
  if (a.bf16_grads && backward_grads_bf16<T>(ctx, a, w, q, k, v, g, beta, dout, dq, dk, dv, dg, dbeta, op)) return;
  if (backward_grads_tf32<T>(ctx, a, w, q, k, v, g, beta, dout, dq, dk, dv, dg, dbeta, op)) return;
  const size_t none = floats(4 * kC * a.dk + kC * kC + 2 * kC), inputs = none + 2 * kC * a.dk * sizeof(T),
               outputs = inputs + kC * a.dv * (sizeof(T) + sizeof(float)), limit = shared_limit(op);
  const auto launch = [&]<GradsStaging staging>(size_t bytes) {
    allow_shared(grads_kernel<T, staging>, bytes, op);
    grads_kernel<T, staging><<<chunks_grid(a), kGradsThreads, bytes, stream(ctx)>>>(a, w, q, k, v, g, beta, dout, dq,
                                                                                   dk, dv, dg, dbeta);
  };
  if (outputs <= limit)
    launch.template operator()<GradsStaging::outputs>(outputs);
  else if (inputs <= limit)
    launch.template operator()<GradsStaging::inputs>(inputs);
  else
    launch.template operator()<GradsStaging::none>(none);
  check_launch(op, "grads_kernel");
}

}  // namespace

}  // namespace kda_chunked

void kda_chunked_backward(const ExecContext& ctx, const KdaArgs& a, const void* q, const void* k, const void* v,
                          const void* g, const void* beta, const float* h0, const void* dout, const float* dht,
                          void* dq, void* dk, void* dv, void* dg, void* dbeta, float* dh0, float* workspace) {
  using namespace kda_chunked;
  if (a.num_seqs == 0 || a.heads == 0 || a.dv == 0) return;
  KILN_CHECK(a.dk >= 1 && a.dk <= kKdaChunkedMaxDk, "kda_chunked_backward", "d_k must be 1..{} on the GPU, got {}",
             kKdaChunkedMaxDk, a.dk);
  by_dtype(a.dtype, [&]<typename T>() {
    backward_launch<T>(ctx, a, static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v),
                       static_cast<const T*>(g), static_cast<const T*>(beta), h0, static_cast<const T*>(dout), dht,
                       static_cast<T*>(dq), static_cast<T*>(dk), static_cast<T*>(dv), static_cast<T*>(dg),
                       static_cast<T*>(dbeta), dh0, workspace);
  });
}

}  // namespace kiln::cuda

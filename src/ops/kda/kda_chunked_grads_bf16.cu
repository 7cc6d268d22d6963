// Chunked KDA: the backward's per-chunk gradients with their products on bf16 tensor cores
// (model.kda.gpu_kernel = "chunked_bf16"; the same results as grads_tf32_kernel's, to bf16
// operand rounding). grads_tf32_kernel keeps a whole chunk's [C, d_k] fp32 tiles in 218 KiB
// of shared memory, one block per SM, its wmma fragments loaded from fp32 tiles: it was
// latency-bound. Here, as in flash-linear-attention's chunk_kda backward, the work splits by
// what couples channels:
//   values  per (chunk, head): X_v = M^T dD, dv = beta X_v, dL = -X_v D^T (s < r) and the
//           part of dbeta that sums over d_v and pairs: v . X_v + sum_{s<r} dL A.
//           dL = -(X_v U^T + X_k W^T) = -M^T dD (U - W S_0)^T = -X_v D^T: no X_k needed.
//   grads   per (chunk, head, slab of 32 (or 16) channels): dq, dk, dg of its channels
//           (everything there is per channel given the pair matrices dP and dL), and its
//           channels' share of dbeta, Kg . X_k; 105 KiB of shared memory at 32 channels, so
//           two 512-thread blocks share an SM.
//   dbeta   per (chunk, head): the shares added in slab order.
// Products run by warp_mma_bf16 (X_v and X_k by warp_mma_bf16_split_b, dD and dW kept to
// about 16 mantissa bits for dbeta's sake; operands loaded through accessors into registers), their
// elementwise terms fused into the epilogues; the pairwise gradients are
// pairwise_gradient_tf32's. Workspace use: dL in P's tile and the dbeta shares in Tl's (both
// read by no later kernel), dW and X_v as before; X_k is not written. No atomics.
#include "ops/kda/kda_chunked_common.cuh"
#include "ops/kda/kda_chunked_mma_bf16.cuh"
#include "ops/kda/kda_chunked_pairwise.cuh"

namespace kiln::cuda::kda_chunked {

namespace {

constexpr int kValuesThreads = 256;
constexpr int kSlabThreads = 512;

// The slab width: 32 channels where d_k allows, else 16 (d_k is a multiple of 16 here).
inline int slab_width(int64_t dk) { return dk % 32 == 0 ? 32 : 16; }

// Tl's tile of (slot, head) holds the dbeta terms: the values kernel's at [0, C), slab z's at
// [C (z + 1), C (z + 2)); C (d_k / 16 + 1) <= C d_k floats.
__device__ float* dbeta_terms(const Tiles& w, int64_t at) { return w.Tl + at * w.ck; }

template <typename T>
__global__ void __launch_bounds__(kValuesThreads) values_bf16_kernel(KdaArgs s, Tiles w, const T* v, const T* beta,
                                                                    T* dv_out) {
  Chunk c;
  if (!locate(s, blockIdx.x, c)) return;
  const int64_t h = blockIdx.y, H = s.heads, dv = s.dv, len = c.len, at = c.slot * H + h;
  const int warp = threadIdx.x / 32, warps = blockDim.x / 32, lane = threadIdx.x & 31;
  const float* M = w.M + at * w.cc;
  const float* A = w.A + at * w.cc;
  const float* D = w.D + at * w.cv;
  const float* dD = w.dD + at * w.cv;
  float* Xv = w.Xv + at * w.cv;
  float* dL = w.P + at * w.cc;
  const auto vrow = [&](int64_t r) { return ((c.first + r) * H + h) * dv; };
  const auto beta_at = [&](int64_t r) { return to_f32(beta[(c.first + r) * H + h]); };
  // X_v [C, d_v] = M^T dD, all C rows (zero past len); dv = beta X_v.
  const int vtiles = static_cast<int>(dv / 16);
  for (int t = warp; t < kSubs * vtiles; t += warps) {
    const int r0 = kSub * (t / vtiles), j0 = 16 * (t % vtiles);
    WarpTile tile;
    warp_mma_bf16_split_b(
        kC, [&](int r, int k) { return r0 + r < len && k < len ? M[k * kC + r0 + r] : 0.f; },
        [&](int k, int n) { return k < len ? dD[k * dv + j0 + n] : 0.f; }, tile);
    tile.each([&](int r, int n, float x) {
      const int64_t row = r0 + r, j = j0 + n;
      Xv[row * dv + j] = x;
      if (row < len) from_f32(beta_at(row) * x, dv_out + vrow(row) + j);
    });
  }
  __syncthreads();  // X_v read back below (global memory, this block's writes)
  // dL [C, C] = -X_v D^T for s < r < len, zero elsewhere (grads copies the whole tile).
  for (int t = warp; t < kSubs * kSubs; t += warps) {
    const int r0 = kSub * (t / kSubs), s0 = kSub * (t % kSubs);
    WarpTile tile;
    if (s0 <= r0)
      warp_mma_bf16(
          static_cast<int>(dv), [&](int r, int k) { return Xv[(r0 + r) * dv + k]; },
          [&](int k, int n) { return s0 + n < len ? D[(s0 + n) * dv + k] : 0.f; }, tile);
    tile.each([&](int r, int n, float x) {
      const int row = r0 + r, col = s0 + n;
      dL[row * kC + col] = row < len && col < row ? -x : 0.f;
    });
  }
  __syncthreads();
  // dbeta's terms here, a warp per row: v_r . X_v[r] + sum_{s<r} dL_rs A_rs.
  float* terms = dbeta_terms(w, at);
  for (int r = warp; r < kC; r += warps) {
    float acc = 0.f;
    if (r < len) {
      for (int64_t j = lane; j < dv; j += 32) acc += to_f32(v[vrow(r) + j]) * Xv[r * dv + j];
      for (int col = lane; col < r; col += 32) acc += dL[r * kC + col] * A[r * kC + col];
      acc = warp_sum(acc);
    }
    if (lane == 0) terms[r] = acc;
  }
}

// One block per (chunk, head, slab of `width` channels from i0 = blockIdx.z width). Shared:
// the pairwise sums' staging (kPairStage floats, first: 32-byte aligned), cum, gq, gk, gc and
// tl [C, width] (tl: the Kd terms' shares of dG_last, then the slab's Kg . X_k terms), a pair
// matrix [C, C] (dP, then dL), beta [C], and the slab's k and q rows, T [C, width] each.
template <typename T>
__global__ void __launch_bounds__(kSlabThreads, 2)
    grads_bf16_kernel(KdaArgs s, Tiles w, int width, const T* q, const T* k, const T* g, const T* beta,
                      const T* dout, T* dq_out, T* dk_out, T* dg) {
  extern __shared__ __align__(32) float sm[];  // the staging first: wmma wants 32-byte tiles
  Chunk c;
  if (!locate(s, blockIdx.x, c)) return;
  const int64_t h = blockIdx.y, H = s.heads, dk = s.dk, dv = s.dv, len = c.len, last = len - 1;
  const int64_t at = c.slot * H + h, i0 = int64_t{blockIdx.z} * width;
  const int W = width, warp = threadIdx.x / 32, warps = blockDim.x / 32, lane = threadIdx.x & 31;
  const float scale = s.scale;
  float* stage = sm;
  float* cum = stage + kPairStage;
  float* gq = cum + kC * W;
  float* gk = gq + kC * W;
  float* gc = gk + kC * W;
  float* tl = gc + kC * W;
  float* pm = tl + kC * W;
  float* bt = pm + kC * kC;
  T* ks = reinterpret_cast<T*>(bt + kC);
  T* qs = ks + kC * W;
  const auto slab = [&](Rows<T> x) { return Rows<T>{x.first + i0, x.stride}; };
  const Rows<T> kg = slab(rows_of(k, s, c, h, dk)), qg = slab(rows_of(q, s, c, h, dk));
  start_copy(ks, W, kg.first, kg.stride, len, W);
  start_copy(qs, W, qg.first, qg.stride, len, W);
  const Rows<T> key{ks, W}, query{qs, W};  // rows < len only
  const float* S0 = w.S0 + at * w.kv + i0;  // [d_v, d_k]: column i of the slab at S0[j d_k + i]
  const float* dS = w.dS + at * w.kv + i0;
  const float* D = w.D + at * w.cv;
  const float* dD = w.dD + at * w.cv;
  const float* M = w.M + at * w.cc;
  float* dW = w.dW + at * w.ck + i0;  // the slab's columns of [C, d_k]
  const auto vrow = [&](int64_t r) { return ((c.first + r) * H + h) * dv; };
  const auto out_grad = [&](int64_t r, int64_t j) { return r < len ? to_f32(dout[vrow(r) + j]) : 0.f; };

  cumulative_decay(W, slab(rows_of(g, s, c, h, dk)), len, cum, W);
  for (int r = threadIdx.x; r < kC; r += blockDim.x) bt[r] = r < len ? to_f32(beta[(c.first + r) * H + h]) : 0.f;
  finish_copies();
  // The products over d_v, independent of each other: dP (its tiles on and below the
  // diagonal; pairwise_gradient_tf32 reads no other), dO S_0 and D dS with the elementwise
  // terms that start gq, gk, gc (as grads_tf32_kernel's), and dW = -dD S_0 (the slab's
  // columns, all C rows) for X_k.
  const int ctiles = W / 16, pair_jobs = kSubs * (kSubs + 1) / 2, slab_jobs = kSubs * ctiles;
  for (int t = warp; t < pair_jobs + 2 * slab_jobs; t += warps) {
    WarpTile tile;
    if (t < pair_jobs) {
      int tr = 0;
      while ((tr + 1) * (tr + 2) / 2 <= t) ++tr;  // lower-triangle tile t = tr (tr + 1) / 2 + tc
      const int r0 = kSub * tr, s0 = kSub * (t - tr * (tr + 1) / 2);
      warp_mma_bf16(
          static_cast<int>(dv), [&](int r, int j) { return out_grad(r0 + r, j); },
          [&](int j, int n) { return s0 + n < len ? D[(s0 + n) * dv + j] : 0.f; }, tile);
      tile.each([&](int r, int n, float x) {
        const int row = r0 + r, col = s0 + n;
        pm[row * kC + col] = row < len && col <= row ? scale * x : 0.f;
      });
      continue;
    }
    const int u = (t - pair_jobs) % slab_jobs, r0 = kSub * (u / ctiles), n0 = 16 * (u % ctiles);
    if (t - pair_jobs < slab_jobs) {
      WarpTile skd;
      warp_mma_bf16(
          static_cast<int>(dv), [&](int r, int j) { return out_grad(r0 + r, j); },
          [&](int j, int n) { return S0[j * dk + n0 + n]; }, tile);
      warp_mma_bf16(
          static_cast<int>(dv), [&](int r, int j) { return r0 + r < len ? D[(r0 + r) * dv + j] : 0.f; },
          [&](int j, int n) { return dS[j * dk + n0 + n]; }, skd);
#pragma unroll
      for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int n = 0; n < 4; ++n) {
          const int r = r0 + WarpTile::row(n), i = n0 + WarpTile::col(half, n), e = r * W + i;
          if (r >= len) {
            gq[e] = gk[e] = gc[e] = tl[e] = 0.f;
            continue;
          }
          const float sdo = tile.acc[half][n], sk = skd.acc[half][n];
          const float er = expf(cum[e]), el = expf(cum[last * W + i] - cum[e]);
          gq[e] = scale * er * sdo;
          gk[e] = el * sk;
          const float tt = r == last ? 0.f : key(r, i) * el * sk;
          tl[e] = tt;
          gc[e] = scale * query(r, i) * er * sdo - tt;
        }
    } else {
      warp_mma_bf16(
          static_cast<int>(dv), [&](int r, int j) { return r0 + r < len ? dD[(r0 + r) * dv + j] : 0.f; },
          [&](int j, int n) { return S0[j * dk + n0 + n]; }, tile);
      tile.each([&](int r, int n, float x) { dW[(r0 + r) * dk + n0 + n] = -x; });
    }
  }
  __syncthreads();
  // dG_last: the Kd terms' shares and S_0's decay, a warp per channel.
  for (int i = warp; i < W; i += warps) {
    float acc = 0.f, decay = 0.f;
    for (int64_t r = lane; r < last; r += 32) acc += tl[r * W + i];
    for (int64_t j = lane; j < dv; j += 32) decay += S0[j * dk + i] * dS[j * dk + i];
    acc = warp_sum(acc), decay = warp_sum(decay);
    if (lane == 0) gc[last * W + i] += acc + expf(cum[last * W + i]) * decay;
  }
  __syncthreads();
  // P's pairwise terms (with the diagonal); it ends synced.
  const auto unit = [](int64_t) { return 1.f; };
  pairwise_gradient_tf32(len, W, cum, pm, true, query, key, unit, gq, gk, gc, stage);
  // dL (the values kernel's, already masked) into the pair matrix; X_k = M^T dW with its
  // terms of dk and dG, and the slab's Kg . X_k terms of dbeta into tl.
  const float* dL = w.P + at * w.cc;
  for (int e = threadIdx.x; e < kC * kC; e += blockDim.x) pm[e] = dL[e];
  for (int t = warp; t < kSubs * ctiles; t += warps) {
    const int r0 = kSub * (t / ctiles), n0 = 16 * (t % ctiles);
    WarpTile tile;
    warp_mma_bf16_split_b(
        kC, [&](int r, int m) { return r0 + r < len && m < len ? M[m * kC + r0 + r] : 0.f; },
        [&](int m, int n) { return dW[m * dk + n0 + n]; }, tile);
    tile.each([&](int r, int n, float x) {
      const int col = r0 + r, i = n0 + n, e = col * W + i;
      if (col >= len) {
        tl[e] = 0.f;
        return;
      }
      const float ec = expf(cum[e]), kx = key(col, i) * ec * x;
      gk[e] += bt[col] * ec * x;
      gc[e] += bt[col] * kx;
      tl[e] = kx;
    });
  }
  __syncthreads();
  float* terms = dbeta_terms(w, at) + kC * (blockIdx.z + 1);
  for (int r = threadIdx.x; r < kC; r += blockDim.x) {
    float acc = 0.f;
    for (int i = 0; i < W; ++i) acc += tl[r * W + i];
    terms[r] = acc;
  }
  // A's pairwise terms with dA_rs = beta_r dL_rs; it starts reading what the block wrote
  // before the barrier above and ends synced.
  const auto beta_of = [&](int64_t r) { return bt[r]; };
  pairwise_gradient_tf32(len, W, cum, pm, false, key, key, beta_of, gk, gk, gc, stage);
  // dg = the reversed cumulative sum of dG, a thread per channel; dq, dk out.
  const auto krow = [&](int64_t r) { return ((c.first + r) * H + h) * dk + i0; };
  for (int i = threadIdx.x; i < W; i += blockDim.x) {
    float acc = 0.f;
    for (int64_t r = last; r >= 0; --r) {
      acc += gc[r * W + i];
      from_f32(acc, dg + krow(r) + i);
    }
  }
  for (int e = threadIdx.x; e < len * W; e += blockDim.x) {
    const int64_t r = e / W, i = e % W;
    from_f32(gq[e], dq_out + krow(r) + i);
    from_f32(gk[e], dk_out + krow(r) + i);
  }
}

// dbeta = the values kernel's terms + each slab's, in slab order: a thread per row.
template <typename T>
__global__ void dbeta_bf16_kernel(KdaArgs s, Tiles w, int slabs, T* dbeta) {
  Chunk c;
  if (!locate(s, blockIdx.x, c)) return;
  const int64_t h = blockIdx.y, H = s.heads;
  const float* terms = dbeta_terms(w, c.slot * H + h);
  for (int r = threadIdx.x; r < c.len; r += blockDim.x) {
    float acc = terms[r];
    for (int z = 0; z < slabs; ++z) acc += terms[kC * (z + 1) + r];
    from_f32(acc, dbeta + (c.first + r) * H + h);
  }
}

}  // namespace

template <typename T>
bool backward_grads_bf16(const ExecContext& ctx, const KdaArgs& a, const Tiles& w, const T* q, const T* k,
                         const T* v, const T* g, const T* beta, const T* dout, T* dq, T* dk, T* dv, T* dg, T* dbeta,
                         const char* op) {
  if constexpr (std::is_same_v<T, bf16>) {
    if (engine_of<T>(a) != Engine::tf32) return false;  // bf16 inputs, d_k and d_v multiples of 16
    const int width = slab_width(a.dk), slabs = static_cast<int>(a.dk / width);
    const size_t bytes = floats(kPairStage + 5 * kC * width + kC * kC + kC) + 2 * kC * width * sizeof(T);
    if (bytes > shared_limit(op)) return false;
    const dim3 chunks = chunks_grid(a);
    values_bf16_kernel<T><<<chunks, kValuesThreads, 0, stream(ctx)>>>(a, w, v, beta, dv);
    check_launch(op, "values_bf16_kernel");
    allow_shared(grads_bf16_kernel<T>, bytes, op);
    grads_bf16_kernel<T><<<dim3(chunks.x, chunks.y, slabs), kSlabThreads, bytes, stream(ctx)>>>(
        a, w, width, q, k, g, beta, dout, dq, dk, dg);
    check_launch(op, "grads_bf16_kernel");
    dbeta_bf16_kernel<T><<<chunks, kC, 0, stream(ctx)>>>(a, w, slabs, dbeta);
    check_launch(op, "dbeta_bf16_kernel");
    return true;
  }
  return false;
}

template bool backward_grads_bf16<float>(const ExecContext&, const KdaArgs&, const Tiles&, const float*, const float*,
                                         const float*, const float*, const float*, const float*, float*, float*,
                                         float*, float*, float*, const char*);
template bool backward_grads_bf16<bf16>(const ExecContext&, const KdaArgs&, const Tiles&, const bf16*, const bf16*,
                                        const bf16*, const bf16*, const bf16*, const bf16*, bf16*, bf16*, bf16*,
                                        bf16*, bf16*, const char*);

}  // namespace kiln::cuda::kda_chunked

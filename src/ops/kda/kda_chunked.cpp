// KDA by chunks: the WY (UT-transform) form of the delta rule inside a chunk, then the
// state carried from chunk to chunk, as flash-linear-attention's chunk_kda. Chunks are
// cut per document (the last one of a document may be short), so no chunk spans two.
//
// Forward. Inside a chunk of L tokens, starting from state S_0, write G_r = g_0 + ... +
// g_r (the cumulative log decay, per channel), Gamma_r = Diag(exp(G_r)), and d_r for the
// step's correction beta_r (v_r - k_r^T Diag(e^{g_r}) S_{r-1}). Unrolling the steps,
//   S_r = Gamma_r S_0 + sum_{s<=r} (Gamma_r / Gamma_s) k_s d_s^T,
// so the corrections solve a unit lower-triangular system:
//   d_r + beta_r sum_{s<r} A_rs d_s = beta_r (v_r - (Gamma_r k_r)^T S_0),
//   A_rs = sum_i k_r[i] k_s[i] exp(G_r[i] - G_s[i]).
// With M = (I + Diag(beta) strictly_lower(A))^{-1} (forward substitution), the WY
// factors U = M Diag(beta) V and W = M Diag(beta) (Gamma K) give D = U - W S_0, and then
//   o_r = scale [(Gamma_r q_r)^T S_0 + sum_{s<=r} P_rs d_s],  P_rs = q_r^T (Gamma_r / Gamma_s) k_s
//   S_L = Gamma_{L-1} S_0 + sum_s (Gamma_{L-1} / Gamma_s) k_s d_s^T.
// Every decay ratio is exp(G_r - G_s) with r >= s, at most 1: the pairwise form a GPU
// kernel factors into exp(G_r) exp(-G_s) against a reference point, kept plain here.
//
// Backward (as chunk_kda's backward: states S_0 of every chunk from a forward pass, then
// the chunks in reverse, carrying dS = dL/dS_L, which starts at d_final_state). Per chunk,
// with Qg_r = Gamma_r q_r, Kg_r = Gamma_r k_r, Kd_s = (Gamma_{L-1} / Gamma_s) k_s:
//   dD   = scale P^T dO + Kd dS                          (D reaches O and S_L)
//   dS_0 = Gamma_{L-1} dS + scale Qg^T dO - W^T dD        (the inter-chunk recurrence)
//   dW   = -dD S_0^T,  dU = dD
// then through the triangular solve, with X_v = M^T dU and X_k = M^T dW:
//   dv_c = beta_c X_v[c],  d(Kg)_c = beta_c X_k[c],  dbeta_c = v_c . X_v[c] + Kg_c . X_k[c]
//   d(L) = -M^T dM M^T = -(X_v U^T + X_k W^T)  (strictly lower; L = Diag(beta) A)
//   dbeta_r += sum_{s<r} dL_rs A_rs,   dA_rs = beta_r dL_rs.
// Each pairwise form F_rs = sum_i a_r[i] b_s[i] exp(G_r[i] - G_s[i]) (A with a = b = k,
// P with a = q, b = k) with upstream dF gives da_r[i] += dF b_s[i] e, db_s[i] += dF a_r[i] e,
// dG_r[i] += dF a_r[i] b_s[i] e, dG_s[i] -= the same. dP_rs = scale dO_r . d_s (r >= s).
// The gated vectors: dq_r += Gamma_r dQg_r (dQg = scale S_0 dO_r), dk += Gamma dKg and
// (Gamma_{L-1} / Gamma_s) dKd_s (dKd = dS d_s), each adding x . dx to dG of its
// positions (with a minus for the 1/Gamma_s), and the state's decay adds
// sum_j S_0[i,j] dS[i,j] e^{G_{L-1}[i]} to dG_{L-1}. Finally dg_r = sum_{r'>=r} dG_r'
// (the cumulative sum reversed), and dS_0 becomes the previous chunk's dS; after a
// document's first chunk it is d_initial_state.
#include "ops/kda/kda_cpu.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace kiln::cpu {

namespace {

// Per-thread scratch of one chunk of at most C tokens.
template <typename T>
struct ChunkScratch {
  std::vector<T> cum, a, m, u, w, d, next;
  void size_for(int64_t c, int64_t dk, int64_t dv) {
    cum.resize(c * dk);
    a.resize(c * c);
    m.resize(c * c);
    u.resize(c * dv);
    w.resize(c * dk);
    d.resize(c * dv);
    next.resize(dk * dv);
  }
};

// One chunk of `len` tokens starting at token `first` of head h.
template <typename T>
struct ChunkView {
  const KdaShape& s;
  int64_t first, len, h;
  int64_t row(int64_t r) const { return kda_row(s, first + r, h); }
};

// sum_i a[i] b[i] exp(G_r[i] - G_s[i]).
template <typename T>
T decayed_dot(const T* a, const T* b, const T* cum_r, const T* cum_s, int64_t dk) {
  T acc = 0;
  for (int64_t i = 0; i < dk; ++i) acc += a[i] * b[i] * std::exp(cum_r[i] - cum_s[i]);
  return acc;
}

// The chunk's factors from S_0 = state: G (cum), A (strictly lower), M, U, W and D.
template <typename T>
void prepare(const ChunkView<T>& c, const T* k, const T* v, const T* g, const T* beta, const T* state,
             ChunkScratch<T>& x) {
  const int64_t dk = c.s.dk, dv = c.s.dv, len = c.len;
  for (int64_t r = 0; r < len; ++r)
    for (int64_t i = 0; i < dk; ++i) x.cum[r * dk + i] = g[c.row(r) * dk + i] + (r > 0 ? x.cum[(r - 1) * dk + i] : T(0));
  // M = (I + L)^{-1}, L_rs = beta_r A_rs (s < r): row r of M from the rows above it,
  // M_rs = -sum_{s<=m<r} L_rm M_ms.
  for (int64_t r = 0; r < len; ++r) {
    const T* kr = k + c.row(r) * dk;
    const T br = beta[c.row(r)];
    for (int64_t col = 0; col < len; ++col) x.m[r * len + col] = col == r ? T(1) : T(0);
    for (int64_t mid = 0; mid < r; ++mid) {
      const T arm = decayed_dot(kr, k + c.row(mid) * dk, &x.cum[r * dk], &x.cum[mid * dk], dk);
      x.a[r * len + mid] = arm;
      const T l = br * arm;
      for (int64_t col = 0; col <= mid; ++col) x.m[r * len + col] -= l * x.m[mid * len + col];
    }
  }
  // U = M Diag(beta) V, W = M Diag(beta) Gamma K; then D = U - W S_0.
  for (int64_t r = 0; r < len; ++r) {
    std::fill(x.u.begin() + r * dv, x.u.begin() + (r + 1) * dv, T(0));
    std::fill(x.w.begin() + r * dk, x.w.begin() + (r + 1) * dk, T(0));
    for (int64_t col = 0; col <= r; ++col) {
      const T coef = x.m[r * len + col] * beta[c.row(col)];
      const T *vc = v + c.row(col) * dv, *kc = k + c.row(col) * dk;
      for (int64_t j = 0; j < dv; ++j) x.u[r * dv + j] += coef * vc[j];
      for (int64_t i = 0; i < dk; ++i) x.w[r * dk + i] += coef * std::exp(x.cum[col * dk + i]) * kc[i];
    }
    for (int64_t j = 0; j < dv; ++j) {
      T acc = x.u[r * dv + j];
      for (int64_t i = 0; i < dk; ++i) acc -= x.w[r * dk + i] * state[i * dv + j];
      x.d[r * dv + j] = acc;
    }
  }
}

// S_0 -> S_L in place, from the prepared chunk.
template <typename T>
void advance(const ChunkView<T>& c, const T* k, T* state, ChunkScratch<T>& x) {
  const int64_t dk = c.s.dk, dv = c.s.dv, last = c.len - 1;
  for (int64_t i = 0; i < dk; ++i) {
    const T total = std::exp(x.cum[last * dk + i]);
    for (int64_t j = 0; j < dv; ++j) x.next[i * dv + j] = total * state[i * dv + j];
    for (int64_t col = 0; col < c.len; ++col) {
      const T kc = k[c.row(col) * dk + i] * std::exp(x.cum[last * dk + i] - x.cum[col * dk + i]);
      for (int64_t j = 0; j < dv; ++j) x.next[i * dv + j] += kc * x.d[col * dv + j];
    }
  }
  std::copy(x.next.begin(), x.next.end(), state);
}

// One chunk forward: its outputs, and `state` advanced (S_0 -> S_L).
template <typename T>
void chunk_forward(const ChunkView<T>& c, const T* q, const T* k, const T* v, const T* g, const T* beta, T* out,
                   T* state, ChunkScratch<T>& x) {
  const int64_t dk = c.s.dk, dv = c.s.dv;
  const T scale = static_cast<T>(c.s.scale);
  prepare(c, k, v, g, beta, state, x);
  // Outputs: the inter-chunk part through S_0, the intra-chunk part through D.
  for (int64_t r = 0; r < c.len; ++r) {
    const T* qr = q + c.row(r) * dk;
    T* o = out + c.row(r) * dv;
    for (int64_t j = 0; j < dv; ++j) o[j] = 0;
    for (int64_t i = 0; i < dk; ++i) {
      const T qi = qr[i] * std::exp(x.cum[r * dk + i]);
      for (int64_t j = 0; j < dv; ++j) o[j] += qi * state[i * dv + j];
    }
    for (int64_t col = 0; col <= r; ++col) {
      const T a = decayed_dot(qr, k + c.row(col) * dk, &x.cum[r * dk], &x.cum[col * dk], dk);
      for (int64_t j = 0; j < dv; ++j) o[j] += a * x.d[col * dv + j];
    }
    for (int64_t j = 0; j < dv; ++j) o[j] *= scale;
  }
  advance(c, k, state, x);
}

// Scratch of the backward of one chunk, on top of the forward's.
template <typename T>
struct GradScratch {
  std::vector<T> dd, xv, xk, dw, dq, dk, dcum, ds0;
  void size_for(int64_t c, int64_t nk, int64_t nv) {
    dd.resize(c * nv);
    xv.resize(c * nv);
    xk.resize(c * nk);
    dw.resize(c * nk);
    dq.resize(c * nk);
    dk.resize(c * nk);
    dcum.resize(c * nk);
    ds0.resize(nk * nv);
  }
};

// The backward of one chunk whose entering state is `state` (S_0): from dout and ds =
// dL/dS_L, writes the chunk's rows of dq, dk, dv, dg, dbeta and replaces ds by dL/dS_0.
// The math is in the header comment.
template <typename T>
void chunk_backward(const ChunkView<T>& c, const T* q, const T* k, const T* v, const T* g, const T* beta,
                    const T* state, const T* dout, T* ds, T* dq, T* dk, T* dv, T* dg, T* dbeta, ChunkScratch<T>& x,
                    GradScratch<T>& y) {
  const int64_t nk = c.s.dk, nv = c.s.dv, len = c.len, last = len - 1;
  const T scale = static_cast<T>(c.s.scale);
  prepare(c, k, v, g, beta, state, x);
  std::fill(y.dq.begin(), y.dq.begin() + len * nk, T(0));
  std::fill(y.dk.begin(), y.dk.begin() + len * nk, T(0));
  std::fill(y.dcum.begin(), y.dcum.begin() + len * nk, T(0));
  const T* cum = x.cum.data();
  T *gq = y.dq.data(), *gk = y.dk.data(), *gcum = y.dcum.data();
  // Adds the gradient dF of the pairwise form F_rs = sum_i a_r[i] b_s[i] e^{G_r - G_s} to
  // a (rows of ga), b (rows of gb) and G (nothing on the diagonal, where G_r - G_s = 0).
  auto pairwise = [&](T df, int64_t r, int64_t sidx, const T* a, const T* b, T* ga, T* gb) {
    for (int64_t i = 0; i < nk; ++i) {
      const T e = std::exp(cum[r * nk + i] - cum[sidx * nk + i]);
      ga[i] += df * b[i] * e;
      gb[i] += df * a[i] * e;
      if (r == sidx) continue;
      const T t = df * a[i] * b[i] * e;
      gcum[r * nk + i] += t;
      gcum[sidx * nk + i] -= t;
    }
  };

  // D reaches the outputs (through P) and S_L (through Kd): dD, and dq, dk, dG of P and Kd.
  for (int64_t sidx = 0; sidx < len; ++sidx) {
    const T* ks = k + c.row(sidx) * nk;
    const T* dsx = &x.d[sidx * nv];
    T* dds = &y.dd[sidx * nv];
    std::fill(dds, dds + nv, T(0));
    for (int64_t r = sidx; r < len; ++r) {
      const T* qr = q + c.row(r) * nk;
      const T* dor = dout + c.row(r) * nv;
      const T p = decayed_dot(qr, ks, &cum[r * nk], &cum[sidx * nk], nk);
      T dp = 0;
      for (int64_t j = 0; j < nv; ++j) {
        dds[j] += scale * p * dor[j];
        dp += dor[j] * dsx[j];
      }
      pairwise(scale * dp, r, sidx, qr, ks, gq + r * nk, gk + sidx * nk);
    }
    for (int64_t i = 0; i < nk; ++i) {
      const T e = std::exp(cum[last * nk + i] - cum[sidx * nk + i]);
      T dkd = 0;
      for (int64_t j = 0; j < nv; ++j) {
        dds[j] += ks[i] * e * ds[i * nv + j];
        dkd += ds[i * nv + j] * dsx[j];
      }
      gk[sidx * nk + i] += e * dkd;
      if (sidx == last) continue;
      const T t = ks[i] * e * dkd;
      gcum[last * nk + i] += t;
      gcum[sidx * nk + i] -= t;
    }
  }

  // dS_0 = Gamma_{L-1} dS + scale Qg^T dO - W^T dD, with S_0's decay into dG_{L-1}, and
  // Qg's gradient (scale S_0 dO_r) into dq and dG; dW = -dD S_0^T.
  for (int64_t i = 0; i < nk; ++i) {
    const T e = std::exp(cum[last * nk + i]);
    T dgl = 0;
    for (int64_t j = 0; j < nv; ++j) {
      dgl += state[i * nv + j] * ds[i * nv + j];
      y.ds0[i * nv + j] = e * ds[i * nv + j];
    }
    gcum[last * nk + i] += e * dgl;
  }
  for (int64_t r = 0; r < len; ++r) {
    const T* qr = q + c.row(r) * nk;
    const T* dor = dout + c.row(r) * nv;
    const T* ddr = &y.dd[r * nv];
    for (int64_t i = 0; i < nk; ++i) {
      const T e = std::exp(cum[r * nk + i]);
      const T qg = scale * qr[i] * e, wi = x.w[r * nk + i];
      T sdo = 0, sdd = 0;
      for (int64_t j = 0; j < nv; ++j) {
        y.ds0[i * nv + j] += qg * dor[j] - wi * ddr[j];
        sdo += state[i * nv + j] * dor[j];
        sdd += state[i * nv + j] * ddr[j];
      }
      gq[r * nk + i] += scale * e * sdo;
      gcum[r * nk + i] += scale * qr[i] * e * sdo;
      y.dw[r * nk + i] = -sdd;
    }
  }

  // Through U = M Diag(beta) V and W = M Diag(beta) Kg: X_v = M^T dD, X_k = M^T dW.
  for (int64_t col = 0; col < len; ++col) {
    T* xv = &y.xv[col * nv];
    T* xk = &y.xk[col * nk];
    std::fill(xv, xv + nv, T(0));
    std::fill(xk, xk + nk, T(0));
    for (int64_t r = col; r < len; ++r) {
      const T mrc = x.m[r * len + col];
      for (int64_t j = 0; j < nv; ++j) xv[j] += mrc * y.dd[r * nv + j];
      for (int64_t i = 0; i < nk; ++i) xk[i] += mrc * y.dw[r * nk + i];
    }
    const int64_t rc = c.row(col);
    const T bc = beta[rc];
    const T *vc = v + rc * nv, *kc = k + rc * nk;
    T db = 0;
    for (int64_t j = 0; j < nv; ++j) {
      dv[rc * nv + j] = bc * xv[j];
      db += vc[j] * xv[j];
    }
    for (int64_t i = 0; i < nk; ++i) {
      const T e = std::exp(cum[col * nk + i]);
      db += kc[i] * e * xk[i];
      gk[col * nk + i] += bc * e * xk[i];
      gcum[col * nk + i] += bc * kc[i] * e * xk[i];
    }
    dbeta[rc] = db;
  }
  // Through M = (I + L)^{-1}: dL = -(X_v U^T + X_k W^T) below the diagonal, L = Diag(beta) A.
  for (int64_t r = 1; r < len; ++r) {
    const int64_t rr = c.row(r);
    const T br = beta[rr];
    const T* kr = k + rr * nk;
    T db = 0;
    for (int64_t sidx = 0; sidx < r; ++sidx) {
      T dl = 0;
      for (int64_t j = 0; j < nv; ++j) dl -= y.xv[r * nv + j] * x.u[sidx * nv + j];
      for (int64_t i = 0; i < nk; ++i) dl -= y.xk[r * nk + i] * x.w[sidx * nk + i];
      db += dl * x.a[r * len + sidx];
      pairwise(br * dl, r, sidx, kr, k + c.row(sidx) * nk, gk + r * nk, gk + sidx * nk);
    }
    dbeta[rr] += db;
  }

  // G = cumsum(g): dg is the reversed cumulative sum of dG.
  for (int64_t i = 0; i < nk; ++i) {
    T acc = 0;
    for (int64_t r = last; r >= 0; --r) {
      acc += gcum[r * nk + i];
      dg[c.row(r) * nk + i] = acc;
    }
  }
  for (int64_t r = 0; r < len; ++r)
    for (int64_t i = 0; i < nk; ++i) {
      dq[c.row(r) * nk + i] = gq[r * nk + i];
      dk[c.row(r) * nk + i] = gk[r * nk + i];
    }
  std::copy(y.ds0.begin(), y.ds0.end(), ds);
}

}  // namespace

template <typename T>
void kda_chunked_forward(const KdaShape& s, const T* q, const T* k, const T* v, const T* g, const T* beta,
                         const T* h0, T* out, T* ht) {
  const int64_t size = s.dk * s.dv, work = s.num_seqs * s.heads;
#pragma omp parallel
  {
    ChunkScratch<T> scratch;
    scratch.size_for(s.chunk, s.dk, s.dv);
    std::vector<T> state(size);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < work; ++item) {
      const int64_t seq = item / s.heads, h = item % s.heads;
      if (h0)
        std::copy(h0 + kda_state(s, seq, h), h0 + kda_state(s, seq, h) + size, state.begin());
      else
        std::fill(state.begin(), state.end(), T(0));
      const int64_t begin = s.cu_seqlens[seq], end = s.cu_seqlens[seq + 1];
      for (int64_t first = begin; first < end; first += s.chunk)
        chunk_forward(ChunkView<T>{s, first, std::min(s.chunk, end - first), h}, q, k, v, g, beta, out, state.data(),
                      scratch);
      if (ht) std::copy(state.begin(), state.end(), ht + kda_state(s, seq, h));
    }
  }
}

template <typename T>
void kda_chunked_backward(const KdaShape& s, const T* q, const T* k, const T* v, const T* g, const T* beta,
                          const T* h0, const T* dout, const T* dht, T* dq, T* dk, T* dv, T* dg, T* dbeta, T* dh0) {
  const int64_t size = s.dk * s.dv, work = s.num_seqs * s.heads;
#pragma omp parallel
  {
    ChunkScratch<T> scratch;
    scratch.size_for(s.chunk, s.dk, s.dv);
    GradScratch<T> grad;
    grad.size_for(s.chunk, s.dk, s.dv);
    std::vector<T> states, ds(size);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < work; ++item) {
      const int64_t seq = item / s.heads, h = item % s.heads;
      const int64_t begin = s.cu_seqlens[seq], end = s.cu_seqlens[seq + 1];
      const int64_t chunks = (end - begin + s.chunk - 1) / s.chunk;
      auto view = [&](int64_t n) {
        const int64_t first = begin + n * s.chunk;
        return ChunkView<T>{s, first, std::min(s.chunk, end - first), h};
      };
      // The state entering every chunk (states[n]), by the forward's chunk recurrence.
      states.assign(static_cast<size_t>((chunks + 1) * size), T(0));
      if (h0) std::copy(h0 + kda_state(s, seq, h), h0 + kda_state(s, seq, h) + size, states.begin());
      for (int64_t n = 0; n + 1 < chunks; ++n) {
        T* next = states.data() + (n + 1) * size;
        std::copy(states.begin() + n * size, states.begin() + (n + 1) * size, next);
        const ChunkView<T> c = view(n);
        prepare(c, k, v, g, beta, next, scratch);
        advance(c, k, next, scratch);
      }
      // The chunks in reverse, carrying dL/dS.
      if (dht)
        std::copy(dht + kda_state(s, seq, h), dht + kda_state(s, seq, h) + size, ds.begin());
      else
        std::fill(ds.begin(), ds.end(), T(0));
      for (int64_t n = chunks - 1; n >= 0; --n)
        chunk_backward(view(n), q, k, v, g, beta, states.data() + n * size, dout, ds.data(), dq, dk, dv, dg, dbeta,
                       scratch, grad);
      if (dh0) std::copy(ds.begin(), ds.end(), dh0 + kda_state(s, seq, h));
    }
  }
}

#define KILN_KDA_CHUNKED(T)                                                                                          \
  template void kda_chunked_forward<T>(const KdaShape&, const T*, const T*, const T*, const T*, const T*, const T*,  \
                                       T*, T*);                                                                      \
  template void kda_chunked_backward<T>(const KdaShape&, const T*, const T*, const T*, const T*, const T*,           \
                                        const T*, const T*, const T*, T*, T*, T*, T*, T*, T*);
KILN_KDA_CHUNKED(float)
KILN_KDA_CHUNKED(double)
#undef KILN_KDA_CHUNKED

}  // namespace kiln::cpu

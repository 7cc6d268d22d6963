// KDA by chunks: the WY (UT-transform) form of the delta rule inside a chunk, then the
// state carried from chunk to chunk, as flash-linear-attention's chunk_kda. Chunks are
// cut per document (the last one of a document may be short), so no chunk spans two.
//
// Inside a chunk of L tokens, starting from state S_0, write G_r = g_0 + ... + g_r (the
// cumulative log decay, per channel), Gamma_r = Diag(exp(G_r)), and d_r for the step's
// correction beta_r (v_r - k_r^T Diag(e^{g_r}) S_{r-1}). Unrolling the steps,
//   S_r = Gamma_r S_0 + sum_{s<=r} (Gamma_r / Gamma_s) k_s d_s^T,
// so the corrections solve a unit lower-triangular system:
//   d_r + beta_r sum_{s<r} A_rs d_s = beta_r (v_r - (Gamma_r k_r)^T S_0),
//   A_rs = sum_i k_r[i] k_s[i] exp(G_r[i] - G_s[i]).
// With M = (I + Diag(beta) strictly_lower(A))^{-1} (forward substitution), the WY
// factors U = M Diag(beta) V and W = M Diag(beta) (Gamma K) give D = U - W S_0, and then
//   o_r = scale [(Gamma_r q_r)^T S_0 + sum_{s<=r} (q_r^T (Gamma_r / Gamma_s) k_s) d_s]
//   S_L = Gamma_{L-1} S_0 + sum_s (Gamma_{L-1} / Gamma_s) k_s d_s^T.
// Every decay ratio is exp(G_r - G_s) with r >= s, at most 1: the pairwise form a GPU
// kernel factors into exp(G_r) exp(-G_s) against a reference point, kept plain here.
#include "ops/kda/kda_cpu.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace kiln::cpu {

namespace {

// Per-thread scratch of one chunk of at most C tokens.
template <typename T>
struct ChunkScratch {
  std::vector<T> cum, m, u, w, d, attn, next;
  void size_for(int64_t c, int64_t dk, int64_t dv) {
    cum.resize(c * dk);
    m.resize(c * c);
    u.resize(c * dv);
    w.resize(c * dk);
    d.resize(c * dv);
    attn.resize(c * c);
    next.resize(dk * dv);
  }
};

// One chunk of `len` tokens starting at token `first` of head h: writes its outputs and
// advances `state` (S_0 -> S_L).
template <typename T>
void chunk(const KdaShape& s, int64_t first, int64_t len, int64_t h, const T* q, const T* k, const T* v, const T* g,
           const T* beta, T* out, T* state, ChunkScratch<T>& x) {
  const int64_t dk = s.dk, dv = s.dv;
  const T scale = static_cast<T>(s.scale);
  auto row = [&](int64_t r) { return kda_row(s, first + r, h); };
  // Cumulative log decays G.
  for (int64_t r = 0; r < len; ++r)
    for (int64_t i = 0; i < dk; ++i) x.cum[r * dk + i] = g[row(r) * dk + i] + (r > 0 ? x.cum[(r - 1) * dk + i] : T(0));
  // q_r^T (Gamma_r / Gamma_s) k_s for s <= r, with vectors a and b.
  auto decayed_dot = [&](const T* a, int64_t r, const T* b, int64_t sidx) {
    T acc = 0;
    for (int64_t i = 0; i < dk; ++i) acc += a[i] * b[i] * std::exp(x.cum[r * dk + i] - x.cum[sidx * dk + i]);
    return acc;
  };
  // M = (I + L)^{-1}, L_rs = beta_r A_rs (s < r): row r of M from the rows above it,
  // M_rs = -sum_{s<=m<r} L_rm M_ms.
  for (int64_t r = 0; r < len; ++r) {
    const T* kr = k + row(r) * dk;
    const T br = beta[row(r)];
    for (int64_t c = 0; c < len; ++c) x.m[r * len + c] = c == r ? T(1) : T(0);
    for (int64_t mid = 0; mid < r; ++mid) {
      const T l = br * decayed_dot(kr, r, k + row(mid) * dk, mid);
      for (int64_t c = 0; c <= mid; ++c) x.m[r * len + c] -= l * x.m[mid * len + c];
    }
  }
  // U = M Diag(beta) V, W = M Diag(beta) Gamma K; then D = U - W S_0.
  for (int64_t r = 0; r < len; ++r) {
    std::fill(x.u.begin() + r * dv, x.u.begin() + (r + 1) * dv, T(0));
    std::fill(x.w.begin() + r * dk, x.w.begin() + (r + 1) * dk, T(0));
    for (int64_t c = 0; c <= r; ++c) {
      const T coef = x.m[r * len + c] * beta[row(c)];
      const T *vc = v + row(c) * dv, *kc = k + row(c) * dk;
      for (int64_t j = 0; j < dv; ++j) x.u[r * dv + j] += coef * vc[j];
      for (int64_t i = 0; i < dk; ++i) x.w[r * dk + i] += coef * std::exp(x.cum[c * dk + i]) * kc[i];
    }
    for (int64_t j = 0; j < dv; ++j) {
      T acc = x.u[r * dv + j];
      for (int64_t i = 0; i < dk; ++i) acc -= x.w[r * dk + i] * state[i * dv + j];
      x.d[r * dv + j] = acc;
    }
  }
  // Outputs: the inter-chunk part through S_0, the intra-chunk part through D.
  for (int64_t r = 0; r < len; ++r) {
    const T* qr = q + row(r) * dk;
    T* o = out + row(r) * dv;
    for (int64_t j = 0; j < dv; ++j) o[j] = 0;
    for (int64_t i = 0; i < dk; ++i) {
      const T qi = qr[i] * std::exp(x.cum[r * dk + i]);
      for (int64_t j = 0; j < dv; ++j) o[j] += qi * state[i * dv + j];
    }
    for (int64_t c = 0; c <= r; ++c) {
      const T a = decayed_dot(qr, r, k + row(c) * dk, c);
      for (int64_t j = 0; j < dv; ++j) o[j] += a * x.d[c * dv + j];
    }
    for (int64_t j = 0; j < dv; ++j) o[j] *= scale;
  }
  // The state after the chunk.
  const int64_t last = len - 1;
  for (int64_t i = 0; i < dk; ++i) {
    const T total = std::exp(x.cum[last * dk + i]);
    for (int64_t j = 0; j < dv; ++j) x.next[i * dv + j] = total * state[i * dv + j];
    for (int64_t c = 0; c < len; ++c) {
      const T kc = k[row(c) * dk + i] * std::exp(x.cum[last * dk + i] - x.cum[c * dk + i]);
      for (int64_t j = 0; j < dv; ++j) x.next[i * dv + j] += kc * x.d[c * dv + j];
    }
  }
  std::copy(x.next.begin(), x.next.end(), state);
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
        chunk(s, first, std::min(s.chunk, end - first), h, q, k, v, g, beta, out, state.data(), scratch);
      if (ht) std::copy(state.begin(), state.end(), ht + kda_state(s, seq, h));
    }
  }
}

template void kda_chunked_forward<float>(const KdaShape&, const float*, const float*, const float*, const float*,
                                         const float*, const float*, float*, float*);
template void kda_chunked_forward<double>(const KdaShape&, const double*, const double*, const double*,
                                          const double*, const double*, const double*, double*, double*);

}  // namespace kiln::cpu

#include "ops/attention/attention_cpu.h"
#include "ops/attention/attention_math.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace kiln::cpu {

namespace {

// First key a query at row i of a sequence starting at `begin` may see.
int64_t first_key(int64_t i, int64_t begin, int64_t window) {
  return window > 0 ? std::max(begin, i - window + 1) : begin;
}

// Scores of query qi against keys [j0, j1) (after scale and optional softcap) into s;
// with a softcap, t receives tanh(raw / cap) for the backward.
template <typename T>
void block_scores(const AttentionShape& sh, const T* qi, const T* k, int64_t g, int64_t j0, int64_t j1, T* s, T* t) {
  const int64_t d = sh.head_dim;
  const T scale = static_cast<T>(sh.scale);
  for (int64_t j = j0; j < j1; ++j) s[j - j0] = dot(qi, k + (j * sh.kv_heads + g) * d, d) * scale;
  if (sh.softcap > 0) {
    const T cap = static_cast<T>(sh.softcap);
    for (int64_t j = 0; j < j1 - j0; ++j) {
      t[j] = std::tanh(s[j] / cap);
      s[j] = t[j] * cap;
    }
  }
}

}  // namespace

template <typename T>
void attention_forward(const AttentionShape& sh, const T* q, const T* k, const T* v, T* out, T* lse) {
  const int64_t d = sh.head_dim, group = sh.q_heads / sh.kv_heads;
  const int64_t work = sh.num_seqs * sh.q_heads;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t item = 0; item < work; ++item) {
    const int64_t seq = item / sh.q_heads, h = item % sh.q_heads, g = h / group;
    const int64_t begin = sh.cu_seqlens[seq], end = sh.cu_seqlens[seq + 1];
    T acc[kMaxAttentionHeadDim], s[kKeyBlock], t[kKeyBlock];
    for (int64_t i = begin; i < end; ++i) {
      const T* qi = q + (i * sh.q_heads + h) * d;
      T m = -std::numeric_limits<T>::infinity(), l = 0;
      std::fill(acc, acc + d, T(0));
      for (int64_t j0 = first_key(i, begin, sh.window); j0 <= i; j0 += kKeyBlock) {
        const int64_t j1 = std::min(j0 + kKeyBlock, i + 1);
        block_scores(sh, qi, k, g, j0, j1, s, t);
        fold_key_block(s, j0, j1 - j0, m, l, acc, d, [&](int64_t j) { return v + (j * sh.kv_heads + g) * d; });
      }
      T* oi = out + (i * sh.q_heads + h) * d;
      const T inv = T(1) / l;
      for (int64_t c = 0; c < d; ++c) oi[c] = acc[c] * inv;
      lse[i * sh.q_heads + h] = m + std::log(l);
    }
  }
}

// With P = softmax(S): dV += P^T dO; dP = dO V^T; dS = P * (dP - rowsum(dO * O));
// dQ = scale dS K; dK = scale dS^T Q (through the softcap's tanh derivative if on).
template <typename T>
void attention_backward(const AttentionShape& sh, const T* q, const T* k, const T* v, const T* out, const T* lse,
                        const T* dout, T* dq, T* dk, T* dv) {
  const int64_t d = sh.head_dim, group = sh.q_heads / sh.kv_heads;
  const int64_t work = sh.num_seqs * sh.kv_heads;
  const T scale = static_cast<T>(sh.scale);
  // One work item per (sequence, kv head): it owns dk/dv of that head and dq of the
  // query heads in its group, so no two threads write the same element.
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t item = 0; item < work; ++item) {
    const int64_t seq = item / sh.kv_heads, g = item % sh.kv_heads;
    const int64_t begin = sh.cu_seqlens[seq], end = sh.cu_seqlens[seq + 1];
    T s[kKeyBlock], t[kKeyBlock];
    for (int64_t j = begin; j < end; ++j) {
      std::memset(dk + (j * sh.kv_heads + g) * d, 0, sizeof(T) * d);
      std::memset(dv + (j * sh.kv_heads + g) * d, 0, sizeof(T) * d);
    }
    for (int64_t h = g * group; h < (g + 1) * group; ++h) {
      for (int64_t i = begin; i < end; ++i) {
        const T* qi = q + (i * sh.q_heads + h) * d;
        const T* doi = dout + (i * sh.q_heads + h) * d;
        T* dqi = dq + (i * sh.q_heads + h) * d;
        std::memset(dqi, 0, sizeof(T) * d);
        const T delta = dot(doi, out + (i * sh.q_heads + h) * d, d);
        const T lse_i = lse[i * sh.q_heads + h];
        for (int64_t j0 = first_key(i, begin, sh.window); j0 <= i; j0 += kKeyBlock) {
          const int64_t j1 = std::min(j0 + kKeyBlock, i + 1);
          block_scores(sh, qi, k, g, j0, j1, s, t);
          for (int64_t j = j0; j < j1; ++j) {
            const T* kj = k + (j * sh.kv_heads + g) * d;
            const T* vj = v + (j * sh.kv_heads + g) * d;
            const T p = std::exp(s[j - j0] - lse_i);
            axpy(p, doi, dv + (j * sh.kv_heads + g) * d, d);
            T ds = p * (dot(doi, vj, d) - delta);
            if (sh.softcap > 0) ds *= T(1) - t[j - j0] * t[j - j0];
            ds *= scale;
            axpy(ds, kj, dqi, d);
            axpy(ds, qi, dk + (j * sh.kv_heads + g) * d, d);
          }
        }
      }
    }
  }
}

template void attention_forward<float>(const AttentionShape&, const float*, const float*, const float*, float*,
                                       float*);
template void attention_forward<double>(const AttentionShape&, const double*, const double*, const double*,
                                        double*, double*);
template void attention_backward<float>(const AttentionShape&, const float*, const float*, const float*,
                                        const float*, const float*, const float*, float*, float*, float*);
template void attention_backward<double>(const AttentionShape&, const double*, const double*, const double*,
                                         const double*, const double*, const double*, double*, double*, double*);

}  // namespace kiln::cpu

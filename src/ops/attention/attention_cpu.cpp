#include "ops/attention/attention_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace kiln::cpu {

namespace {

template <typename T>
T dot(const T* a, const T* b, int64_t n) {
  T sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// First key a query at row i of a sequence starting at `begin` may see.
int64_t first_key(int64_t i, int64_t begin, int64_t window) {
  return window > 0 ? std::max(begin, i - window + 1) : begin;
}

// Score of (q_i, k_j) after scaling and the optional softcap; `tanh_out` receives the
// tanh value the backward needs.
template <typename T>
T score(const T* qi, const T* kj, int64_t d, double scale, double softcap, T* tanh_out) {
  T raw = dot(qi, kj, d) * static_cast<T>(scale);
  if (softcap > 0) {
    const T t = std::tanh(raw / static_cast<T>(softcap));
    if (tanh_out) *tanh_out = t;
    return t * static_cast<T>(softcap);
  }
  return raw;
}

}  // namespace

template <typename T>
void attention_forward(const AttentionShape& s, const T* q, const T* k, const T* v, T* out, T* lse) {
  const int64_t d = s.head_dim, group = s.q_heads / s.kv_heads;
  const int64_t work = s.num_seqs * s.q_heads;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t item = 0; item < work; ++item) {
    const int64_t seq = item / s.q_heads, h = item % s.q_heads, g = h / group;
    const int64_t begin = s.cu_seqlens[seq], end = s.cu_seqlens[seq + 1];
    T acc[kMaxAttentionHeadDim];
    for (int64_t i = begin; i < end; ++i) {
      const T* qi = q + (i * s.q_heads + h) * d;
      // Online softmax: running max m and normalizer l, rescaling acc as m grows.
      T m = -std::numeric_limits<T>::infinity(), l = 0;
      std::fill(acc, acc + d, T(0));
      for (int64_t j = first_key(i, begin, s.window); j <= i; ++j) {
        const T sc = score(qi, k + (j * s.kv_heads + g) * d, d, s.scale, s.softcap, static_cast<T*>(nullptr));
        const T* vj = v + (j * s.kv_heads + g) * d;
        if (sc > m) {
          const T correction = std::exp(m - sc);
          l *= correction;
          for (int64_t c = 0; c < d; ++c) acc[c] *= correction;
          m = sc;
        }
        const T p = std::exp(sc - m);
        l += p;
        for (int64_t c = 0; c < d; ++c) acc[c] += p * vj[c];
      }
      T* oi = out + (i * s.q_heads + h) * d;
      for (int64_t c = 0; c < d; ++c) oi[c] = acc[c] / l;
      lse[i * s.q_heads + h] = m + std::log(l);
    }
  }
}

// With P = softmax(S): dV += P^T dO; dP = dO V^T; dS = P * (dP - rowsum(dO * O));
// dQ = scale dS K; dK = scale dS^T Q (through the softcap's tanh derivative if on).
template <typename T>
void attention_backward(const AttentionShape& s, const T* q, const T* k, const T* v, const T* out, const T* lse,
                        const T* dout, T* dq, T* dk, T* dv) {
  const int64_t d = s.head_dim, group = s.q_heads / s.kv_heads;
  const int64_t work = s.num_seqs * s.kv_heads;
  // One work item per (sequence, kv head): it owns dk/dv of that head and dq of the
  // query heads in its group, so no two threads write the same element.
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t item = 0; item < work; ++item) {
    const int64_t seq = item / s.kv_heads, g = item % s.kv_heads;
    const int64_t begin = s.cu_seqlens[seq], end = s.cu_seqlens[seq + 1];
    for (int64_t j = begin; j < end; ++j) {
      std::memset(dk + (j * s.kv_heads + g) * d, 0, sizeof(T) * d);
      std::memset(dv + (j * s.kv_heads + g) * d, 0, sizeof(T) * d);
    }
    for (int64_t h = g * group; h < (g + 1) * group; ++h) {
      for (int64_t i = begin; i < end; ++i) {
        const T* qi = q + (i * s.q_heads + h) * d;
        const T* doi = dout + (i * s.q_heads + h) * d;
        T* dqi = dq + (i * s.q_heads + h) * d;
        std::memset(dqi, 0, sizeof(T) * d);
        const T delta = dot(doi, out + (i * s.q_heads + h) * d, d);
        const T lse_i = lse[i * s.q_heads + h];
        for (int64_t j = first_key(i, begin, s.window); j <= i; ++j) {
          const T* kj = k + (j * s.kv_heads + g) * d;
          const T* vj = v + (j * s.kv_heads + g) * d;
          T t = 0;
          const T p = std::exp(score(qi, kj, d, s.scale, s.softcap, &t) - lse_i);
          T* dvj = dv + (j * s.kv_heads + g) * d;
          for (int64_t c = 0; c < d; ++c) dvj[c] += p * doi[c];
          T ds = p * (dot(doi, vj, d) - delta);
          if (s.softcap > 0) ds *= (T(1) - t * t);
          ds *= static_cast<T>(s.scale);
          T* dkj = dk + (j * s.kv_heads + g) * d;
          for (int64_t c = 0; c < d; ++c) {
            dqi[c] += ds * kj[c];
            dkj[c] += ds * qi[c];
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

// The row math shared by the CPU attention kernels (packed and KV-cache), so both round
// the same way: decode logits must equal the full forward's.
//
// A query's scores come from keys laid out transposed (kt[c * ld + j]: component c of key
// j), so a score is a sum over the head's components in order while the loop runs across
// keys, up to 64 lanes at a time; the softmax is over the whole row (its maximum, then
// exp(s - max) through cpu::exp_shifted), and the output sums p_j v_j over the keys in
// four interleaved partial sums. (The kernels before these took one dot product and one
// libm exp per key, and took about 40% of a small model's CPU training step.)
#pragma once

#include "ops/cpu_exp.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace kiln::cpu {

// Keys per group of scores: each group's sums stay in registers across the components
// (eight independent AVX2 accumulators: enough to hide the FMA latency).
constexpr int64_t kScoreLanes = 64;

// The leading dimension of transposed keys for n keys: room past the last key for the
// lanes of a last group that runs beyond it (fewer than 32: see transposed_scores).
inline int64_t transposed_ld(int64_t n) { return (n + 31 + 7) / 8 * 8; }

// kt [d, ld] <- rows j < n of a key matrix whose row j starts at base + j * stride; the
// columns from n to ld are zero.
template <typename T>
inline void transpose_keys(const T* base, int64_t stride, int64_t n, int64_t d, T* kt, int64_t ld) {
  for (int64_t c = 0; c < d; ++c) std::fill(kt + c * ld + n, kt + (c + 1) * ld, T(0));
  for (int64_t j = 0; j < n; ++j) {
    const T* row = base + j * stride;
    for (int64_t c = 0; c < d; ++c) kt[c * ld + j] = row[c];
  }
}

// Scores of keys [j0, j0 + lanes): acc in registers across the components; the first
// `width` stored.
template <int64_t kLanes, typename T>
inline void score_group(const T* q, const T* kt, int64_t ld, int64_t j0, int64_t width, int64_t d, T scale, T* s) {
  T acc[kLanes] = {};
  for (int64_t c = 0; c < d; ++c) {
    const T qc = q[c];
    const T* row = kt + c * ld + j0;
#pragma omp simd
    for (int64_t j = 0; j < kLanes; ++j) acc[j] += qc * row[j];
  }
  for (int64_t j = 0; j < width; ++j) s[j0 + j] = acc[j] * scale;
}

// s[j] = scale * sum_c q[c] kt[c * ld + j] for j < n, each sum in order of c (kt holds at
// least n + 31 readable columns from its start). Groups of 64 keys while more than 32
// remain, then one of 32, 16 or 8: a group runs at most 31 lanes past the row, and a score
// does not depend on its group.
template <typename T>
inline void transposed_scores(const T* q, const T* kt, int64_t ld, int64_t n, int64_t d, T scale, T* s) {
  int64_t j0 = 0;
  for (; n - j0 > 32; j0 += kScoreLanes) score_group<kScoreLanes>(q, kt, ld, j0, std::min(kScoreLanes, n - j0), d, scale, s);
  const int64_t rest = n - j0;
  if (rest > 16)
    score_group<32>(q, kt, ld, j0, rest, d, scale, s);
  else if (rest > 8)
    score_group<16>(q, kt, ld, j0, rest, d, scale, s);
  else if (rest > 0)
    score_group<8>(q, kt, ld, j0, rest, d, scale, s);
}

// A softcap on scores: s = cap tanh(s / cap); t (if not null) keeps tanh(s / cap) for the
// backward.
template <typename T>
inline void softcap_scores(T* s, int64_t n, double softcap, T* t) {
  const T cap = static_cast<T>(softcap);
  for (int64_t j = 0; j < n; ++j) {
    const T th = std::tanh(s[j] / cap);
    if (t) t[j] = th;
    s[j] = th * cap;
  }
}

// A fixed-order sum of n values: eight partial sums, then combined pairwise.
template <typename T>
inline T lane_sum(const T* x, int64_t n) {
  T part[8] = {};
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    for (int64_t k = 0; k < 8; ++k) part[k] += x[j + k];
  for (int64_t k = 0; j < n; ++j, ++k) part[k] += x[j];
  return ((part[0] + part[4]) + (part[2] + part[6])) + ((part[1] + part[5]) + (part[3] + part[7]));
}

// The largest of n >= 1 values (eight running maxima, so no chain of dependent steps).
template <typename T>
inline T row_max(const T* x, int64_t n) {
  T part[8];
  std::fill(part, part + 8, x[0]);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    for (int64_t k = 0; k < 8; ++k) part[k] = std::max(part[k], x[j + k]);
  for (int64_t k = 0; j < n; ++j, ++k) part[k] = std::max(part[k], x[j]);
  return std::max(std::max(std::max(part[0], part[1]), std::max(part[2], part[3])),
                  std::max(std::max(part[4], part[5]), std::max(part[6], part[7])));
}

// out [d] = sum_j w[j] row(j) over j < n (row(j): a pointer to d values): four partial
// sums (j mod 4, each in order of j), so four chains of products run at once, then
// (s0 + s1) + (s2 + s3).
template <typename T, typename Row>
inline void weighted_row_sum(const T* w, int64_t n, int64_t d, Row row, T* out) {
  constexpr int64_t kWidth = 16;  // output components per pass, summed in registers
  for (int64_t c0 = 0; c0 < d; c0 += kWidth) {
    const int64_t width = std::min(kWidth, d - c0);
    T acc[4][kWidth] = {};
    if (width == kWidth) {
      int64_t j = 0;
      for (; j + 4 <= n; j += 4)
        for (int64_t u = 0; u < 4; ++u) {
          const T wj = w[j + u];
          const T* r = row(j + u) + c0;
#pragma omp simd
          for (int64_t c = 0; c < kWidth; ++c) acc[u][c] += wj * r[c];
        }
      for (int64_t u = 0; j < n; ++j, ++u) {
        const T wj = w[j];
        const T* r = row(j) + c0;
#pragma omp simd
        for (int64_t c = 0; c < kWidth; ++c) acc[u][c] += wj * r[c];
      }
    } else {
      for (int64_t j = 0; j < n; ++j) {
        const T wj = w[j];
        const T* r = row(j) + c0;
        for (int64_t c = 0; c < width; ++c) acc[j % 4][c] += wj * r[c];
      }
    }
    for (int64_t c = 0; c < width; ++c) out[c0 + c] = (acc[0][c] + acc[1][c]) + (acc[2][c] + acc[3][c]);
  }
}

// row(j) [d] += w[j] x [d] for j < n (row(j): a pointer to d values).
template <typename T, typename Row>
inline void add_scaled_rows(const T* w, int64_t n, const T* x, int64_t d, Row row) {
  constexpr int64_t kWidth = 16;
  for (int64_t c0 = 0; c0 < d; c0 += kWidth) {
    const int64_t width = std::min(kWidth, d - c0);
    if (width == kWidth) {
      T xs[kWidth];
      std::copy(x + c0, x + c0 + kWidth, xs);
      for (int64_t j = 0; j < n; ++j) {
        const T wj = w[j];
        T* r = row(j) + c0;
#pragma omp simd
        for (int64_t c = 0; c < kWidth; ++c) r[c] += wj * xs[c];
      }
    } else {
      for (int64_t j = 0; j < n; ++j) {
        const T wj = w[j];
        T* r = row(j) + c0;
        for (int64_t c = 0; c < width; ++c) r[c] += wj * x[c0 + c];
      }
    }
  }
}

// row(j) [d] += wa[j] xa [d], then += wb[j] xb [d], for j < n: two queries' terms for one
// read and write of each row, added in the order of add_scaled_rows for a, then for b.
template <typename T, typename Row>
inline void add_scaled_rows2(const T* wa, const T* xa, const T* wb, const T* xb, int64_t n, int64_t d, Row row) {
  constexpr int64_t kWidth = 16;
  for (int64_t c0 = 0; c0 < d; c0 += kWidth) {
    const int64_t width = std::min(kWidth, d - c0);
    if (width == kWidth) {
      T as[kWidth], bs[kWidth];
      std::copy(xa + c0, xa + c0 + kWidth, as);
      std::copy(xb + c0, xb + c0 + kWidth, bs);
      for (int64_t j = 0; j < n; ++j) {
        const T a = wa[j], b = wb[j];
        T* r = row(j) + c0;
#pragma omp simd
        for (int64_t c = 0; c < kWidth; ++c) r[c] = (r[c] + a * as[c]) + b * bs[c];
      }
    } else {
      for (int64_t j = 0; j < n; ++j) {
        const T a = wa[j], b = wb[j];
        T* r = row(j) + c0;
        for (int64_t c = 0; c < width; ++c) r[c] = (r[c] + a * xa[c0 + c]) + b * xb[c0 + c];
      }
    }
  }
}

// The softmax of one query's n scores s (replaced by exp(s - m)), and out [d] = the
// probability-weighted sum of the value rows (value_row(j): key j's row), normalized.
// A sink (if not null: a logit with no value, GPT-OSS's) joins the maximum and the
// denominator only. Dropout (if `drop` is not null: each key's 0 or 1 / (1 - p)) weighs
// the values after the denominator is summed, so the log-sum-exp is the undropped one.
// Returns the log-sum-exp m + log(l), the sink's term included.
template <typename T, typename ValueRow>
inline T softmax_combine(T* s, int64_t n, int64_t d, ValueRow value_row, T* out, const T* sink = nullptr,
                         const T* drop = nullptr) {
  const T m = sink ? std::max(row_max(s, n), *sink) : row_max(s, n);
  exp_shifted(s, n, m);
  const T l = sink ? lane_sum(s, n) + std::exp(*sink - m) : lane_sum(s, n);
  if (drop)
    for (int64_t j = 0; j < n; ++j) s[j] *= drop[j];
  weighted_row_sum(s, n, d, value_row, out);
  const T inv = T(1) / l;
  for (int64_t c = 0; c < d; ++c) out[c] *= inv;
  return m + std::log(l);
}

template <typename T>
inline T dot(const T* a, const T* b, int64_t n) {
  T sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

}  // namespace kiln::cpu

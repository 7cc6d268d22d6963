#include "ops/attention/attention_cpu.h"
#include "ops/attention/attention_math.h"
#include "ops/dropout/dropout_mask.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace kiln::cpu {

namespace {

// First key a query at row i of a sequence starting at `begin` may see.
int64_t first_key(int64_t i, int64_t begin, int64_t window) {
  return window > 0 ? std::max(begin, i - window + 1) : begin;
}

// Query row `row` (token * q_heads + head)'s dropout weights of keys [j0, j0 + n): 0 or
// the scale, from dropout::attention_keeps over the keys' packed token indices.
template <typename T>
void dropout_row(const AttentionShape& sh, int64_t row, int64_t j0, int64_t n, T* z) {
  const uint64_t row_key = dropout::attention_row_key(sh.dropout_key, sh.dropout_site, static_cast<uint64_t>(row));
  const T scale = static_cast<T>(sh.dropout_scale);
  for (int64_t j = 0; j < n; ++j)
    z[j] = dropout::attention_keeps(row_key, static_cast<uint64_t>(j0 + j), sh.dropout_threshold) ? scale : T(0);
}

}  // namespace

// Each work item (sequence, query head) transposes its kv head's keys once (attention_math.h),
// then takes each query's row of scores across the keys, its softmax and output.
template <typename T>
void attention_forward(const AttentionShape& sh, const T* q, const T* k, const T* v, T* out, T* lse, const T* sinks) {
  const int64_t d = sh.head_dim, group = sh.q_heads / sh.kv_heads, stride = sh.kv_heads * d;
  const int64_t work = sh.num_seqs * sh.q_heads;
  const T scale = static_cast<T>(sh.scale);
#pragma omp parallel
  {
    std::vector<T> kt, s, z;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < work; ++item) {
      const int64_t seq = item / sh.q_heads, h = item % sh.q_heads, g = h / group;
      const int64_t begin = sh.cu_seqlens[seq], end = sh.cu_seqlens[seq + 1], len = end - begin;
      if (len == 0) continue;
      const int64_t ld = transposed_ld(len);
      kt.resize(static_cast<size_t>(d * ld));
      s.resize(static_cast<size_t>(len));
      z.resize(static_cast<size_t>(len));
      transpose_keys(k + (begin * sh.kv_heads + g) * d, stride, len, d, kt.data(), ld);
      const T* vg = v + g * d;
      for (int64_t i = begin; i < end; ++i) {
        const int64_t j0 = first_key(i, begin, sh.window) - begin, n = i - begin + 1 - j0;
        transposed_scores(q + (i * sh.q_heads + h) * d, kt.data() + j0, ld, n, d, scale, s.data());
        if (sh.softcap > 0) softcap_scores(s.data(), n, sh.softcap, static_cast<T*>(nullptr));
        if (sh.dropout) dropout_row(sh, i * sh.q_heads + h, begin + j0, n, z.data());
        lse[i * sh.q_heads + h] = softmax_combine(s.data(), n, d, [&](int64_t j) { return vg + (begin + j0 + j) * stride; },
                                                  out + (i * sh.q_heads + h) * d, sinks ? sinks + h : nullptr,
                                                  sh.dropout ? z.data() : nullptr);
      }
    }
  }
}

// With P = softmax(S): dV += P^T dO; dP = dO V^T; dS = P * (dP - rowsum(dO * O));
// with dropout (Z: 0 or 1 / (1 - p), O the dropped output) P Z takes P's place in dV and
// dP becomes dP Z: dS = P * (dP Z - rowsum(dO * O)), since rowsum(dO * O) = sum_j P Z dP;
// dQ = scale dS K; dK = scale dS^T Q (through the softcap's tanh derivative if on). The
// scores are the forward's (the same transposed keys and sums); dP takes V transposed alike.
// Queries go in pairs (i, i + 1) of one head, so each key row of dK and dV is read and
// written once per pair (adding query i's term, then i + 1's: the order of one at a time).
//
// Sinks: a sink is one more key of query i, logit s_h, value 0. Its probability
// p_sink = exp(s_h - lse_i) is in lse, so P above (exp(S - lse)) already carries the
// sink's denominator. Softmax's backward dlogit_k = p_k (dp_k - sum_l p_l dp_l), summed over
// all keys l with dp_l = dO_i . v_l: the sink's dp is dO_i . 0 = 0, so the sum is still
// dO_i . O_i = delta_i and dS is unchanged, and the sink's own dlogit is
// p_sink (0 - delta_i). s_h is shared by every query of head h:
//   dsinks[h] += -sum_i exp(s_h - lse_i) (dO_i . O_i).
template <typename T>
void attention_backward(const AttentionShape& sh, const T* q, const T* k, const T* v, const T* out, const T* lse,
                        const T* dout, T* dq, T* dk, T* dv, const T* sinks, T* dsinks) {
  const int64_t d = sh.head_dim, group = sh.q_heads / sh.kv_heads, stride = sh.kv_heads * d;
  const int64_t work = sh.num_seqs * sh.kv_heads;
  const T scale = static_cast<T>(sh.scale);
  // One work item per (sequence, kv head): it owns dk/dv of that head and dq of the
  // query heads in its group, so no two threads write the same element.
#pragma omp parallel
  {
    std::vector<T> kt, vt, buffers;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < work; ++item) {
      const int64_t seq = item / sh.kv_heads, g = item % sh.kv_heads;
      const int64_t begin = sh.cu_seqlens[seq], end = sh.cu_seqlens[seq + 1], len = end - begin;
      if (len == 0) continue;
      const int64_t ld = transposed_ld(len);
      kt.resize(static_cast<size_t>(d * ld));
      vt.resize(static_cast<size_t>(d * ld));
      buffers.resize(static_cast<size_t>(7 * len));
      transpose_keys(k + (begin * sh.kv_heads + g) * d, stride, len, d, kt.data(), ld);
      transpose_keys(v + (begin * sh.kv_heads + g) * d, stride, len, d, vt.data(), ld);
      for (int64_t j = begin; j < end; ++j) {
        std::memset(dk + j * stride + g * d, 0, sizeof(T) * d);
        std::memset(dv + j * stride + g * d, 0, sizeof(T) * d);
      }
      T* const dk_g = dk + g * d;  // key j's dK row at dk_g + j * stride, likewise dV, K
      T* const dv_g = dv + g * d;
      const T* const k_g = k + g * d;
      T* const z = buffers.data() + 6 * len;  // the current query's dropout weights
      // Query i's P (over its keys from j0) and dS into p and ds; dQ written; returns j0.
      // With dropout, p leaves holding P Z (dV's weights).
      auto query = [&](int64_t h, int64_t i, T* p, T* ds, T* t) {
        const T* qi = q + (i * sh.q_heads + h) * d;
        const T* doi = dout + (i * sh.q_heads + h) * d;
        const T delta = dot(doi, out + (i * sh.q_heads + h) * d, d);  // rowsum(dO * O)
        const int64_t j0 = first_key(i, begin, sh.window), n = i + 1 - j0;
        transposed_scores(qi, kt.data() + (j0 - begin), ld, n, d, scale, p);
        if (sh.softcap > 0) softcap_scores(p, n, sh.softcap, t);
        exp_shifted(p, n, lse[i * sh.q_heads + h]);
        transposed_scores(doi, vt.data() + (j0 - begin), ld, n, d, T(1), ds);
        if (sh.dropout) {
          dropout_row(sh, i * sh.q_heads + h, j0, n, z);
          for (int64_t j = 0; j < n; ++j) ds[j] *= z[j];
        }
        if (sh.softcap > 0) {
          for (int64_t j = 0; j < n; ++j) ds[j] = p[j] * (ds[j] - delta) * (T(1) - t[j] * t[j]) * scale;
        } else {
#pragma omp simd
          for (int64_t j = 0; j < n; ++j) ds[j] = p[j] * (ds[j] - delta) * scale;
        }
        weighted_row_sum(ds, n, d, [&](int64_t j) { return k_g + (j0 + j) * stride; }, dq + (i * sh.q_heads + h) * d);
        if (sh.dropout)
          for (int64_t j = 0; j < n; ++j) p[j] *= z[j];
        return j0;
      };
      T* const pa = buffers.data();
      T* const dsa = pa + len;
      T* const pb = dsa + len;
      T* const dsb = pb + len;
      T* const ta = dsb + len;
      T* const tb = ta + len;
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        const T* const q_h = q + h * d;  // query i's row at q_h + i * q_heads * d, likewise dO
        const T* const do_h = dout + h * d;
        const int64_t qs = sh.q_heads * d;
        int64_t i = begin;
        for (; i + 1 < end; i += 2) {
          const int64_t ja = query(h, i, pa, dsa, ta), jb = query(h, i + 1, pb, dsb, tb);
          // Keys [ja, jb) see only query i, [jb, i] both, i + 1 only query i + 1.
          add_scaled_rows(pa, jb - ja, do_h + i * qs, d, [&](int64_t j) { return dv_g + (ja + j) * stride; });
          add_scaled_rows(dsa, jb - ja, q_h + i * qs, d, [&](int64_t j) { return dk_g + (ja + j) * stride; });
          add_scaled_rows2(pa + (jb - ja), do_h + i * qs, pb, do_h + (i + 1) * qs, i + 1 - jb, d,
                           [&](int64_t j) { return dv_g + (jb + j) * stride; });
          add_scaled_rows2(dsa + (jb - ja), q_h + i * qs, dsb, q_h + (i + 1) * qs, i + 1 - jb, d,
                           [&](int64_t j) { return dk_g + (jb + j) * stride; });
          add_scaled_rows(pb + (i + 1 - jb), 1, do_h + (i + 1) * qs, d, [&](int64_t) { return dv_g + (i + 1) * stride; });
          add_scaled_rows(dsb + (i + 1 - jb), 1, q_h + (i + 1) * qs, d, [&](int64_t) { return dk_g + (i + 1) * stride; });
        }
        if (i < end) {
          const int64_t ja = query(h, i, pa, dsa, ta);
          add_scaled_rows(pa, i + 1 - ja, do_h + i * qs, d, [&](int64_t j) { return dv_g + (ja + j) * stride; });
          add_scaled_rows(dsa, i + 1 - ja, q_h + i * qs, d, [&](int64_t j) { return dk_g + (ja + j) * stride; });
        }
      }
    }
  }
  if (!sinks || !dsinks) return;
  // One head per thread, its queries in order: a fixed sum (packed sequences and windows
  // do not matter: every query sees its head's sink).
#pragma omp parallel for schedule(static)
  for (int64_t h = 0; h < sh.q_heads; ++h) {
    T sum = 0;
    for (int64_t i = 0; i < sh.tokens; ++i) {
      const int64_t row = i * sh.q_heads + h;
      sum += std::exp(sinks[h] - lse[row]) * dot(dout + row * d, out + row * d, d);
    }
    dsinks[h] -= sum;
  }
}

template void attention_forward<float>(const AttentionShape&, const float*, const float*, const float*, float*,
                                       float*, const float*);
template void attention_forward<double>(const AttentionShape&, const double*, const double*, const double*,
                                        double*, double*, const double*);
template void attention_backward<float>(const AttentionShape&, const float*, const float*, const float*,
                                        const float*, const float*, const float*, float*, float*, float*,
                                        const float*, float*);
template void attention_backward<double>(const AttentionShape&, const double*, const double*, const double*,
                                         const double*, const double*, const double*, double*, double*, double*,
                                         const double*, double*);

}  // namespace kiln::cpu

// The token-by-token KDA recurrence (the oracle the chunked form and, later, the GPU
// kernels are checked against) and its backward by reverse-time recurrence.
//
// One step, with a = exp(g_t) and S the state before token t:
//   S' = Diag(a) S                      (channel-wise decay of the state's rows)
//   w  = v_t - S'^T k_t                 (what the state mispredicts for key k_t)
//   d  = beta_t w                       (the delta-rule correction)
//   S_t = S' + k_t d^T                  (= (I - beta k k^T) S' + beta k v^T)
//   o_t = scale S_t^T q_t
#include "ops/kda/kda_cpu.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace kiln::cpu {

namespace {

// Scratch of one step: the decayed state S' is written to `decayed`, the correction to
// `delta`, the misprediction to `miss`; `next` receives S_t (it may be `decayed` itself,
// or null when only S', w and d are wanted).
template <typename T>
void step(const KdaShape& s, const T* state, const T* k, const T* v, const T* g, T beta, T* decayed, T* miss,
          T* delta, T* next) {
  const int64_t dk = s.dk, dv = s.dv;
  for (int64_t i = 0; i < dk; ++i) {
    const T a = std::exp(g[i]);
    for (int64_t j = 0; j < dv; ++j) decayed[i * dv + j] = a * state[i * dv + j];
  }
  for (int64_t j = 0; j < dv; ++j) miss[j] = v[j];
  for (int64_t i = 0; i < dk; ++i)
    for (int64_t j = 0; j < dv; ++j) miss[j] -= k[i] * decayed[i * dv + j];
  for (int64_t j = 0; j < dv; ++j) delta[j] = beta * miss[j];
  if (!next) return;
  for (int64_t i = 0; i < dk; ++i)
    for (int64_t j = 0; j < dv; ++j) next[i * dv + j] = decayed[i * dv + j] + k[i] * delta[j];
}

// o = scale S^T q.
template <typename T>
void read_out(const KdaShape& s, const T* state, const T* q, T scale, T* o) {
  std::fill(o, o + s.dv, T(0));
  for (int64_t i = 0; i < s.dk; ++i)
    for (int64_t j = 0; j < s.dv; ++j) o[j] += q[i] * state[i * s.dv + j];
  for (int64_t j = 0; j < s.dv; ++j) o[j] *= scale;
}

// The backward recomputes states block by block from checkpoints taken this many tokens
// apart: memory (T / kBlock + kBlock) states per item instead of T.
constexpr int64_t kBlock = 64;

}  // namespace

template <typename T>
void kda_recurrent_forward(const KdaShape& s, const T* q, const T* k, const T* v, const T* g, const T* beta,
                           const T* h0, T* out, T* ht) {
  const int64_t dk = s.dk, dv = s.dv, work = s.num_seqs * s.heads, size = dk * dv;
  const T scale = static_cast<T>(s.scale);
#pragma omp parallel
  {
    std::vector<T> state(size), miss(dv), delta(dv);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < work; ++item) {
      const int64_t seq = item / s.heads, h = item % s.heads;
      if (h0)
        std::copy(h0 + kda_state(s, seq, h), h0 + kda_state(s, seq, h) + size, state.begin());
      else
        std::fill(state.begin(), state.end(), T(0));
      for (int64_t t = s.cu_seqlens[seq]; t < s.cu_seqlens[seq + 1]; ++t) {
        const int64_t r = kda_row(s, t, h);
        step(s, state.data(), k + r * dk, v + r * dv, g + r * dk, beta[r], state.data(), miss.data(), delta.data(),
             state.data());
        read_out(s, state.data(), q + r * dk, scale, out + r * dv);
      }
      if (ht) std::copy(state.begin(), state.end(), ht + kda_state(s, seq, h));
    }
  }
}

// Reverse time, carrying dS = dL/dS_t (starting from dL/d final state, or zero). At token
// t, with S = S_{t-1}, S' = Diag(a) S, w, d, S_t as in the step above:
//   o_t = scale S_t^T q_t:    dq_t = scale S_t do_t;        dS += scale q_t do_t^T
//   S_t = S' + k d^T:         dd = dS^T k;                  dk_t = dS d;   dS' = dS
//   d = beta w:               dbeta_t = dd . w;             dw = beta dd
//   w = v - S'^T k:           dv_t = dw;   dk_t -= S' dw;   dS' -= k dw^T
//   S' = Diag(a) S, a = e^g:  dg_t[i] = sum_j S'[i,j] dS'[i,j];   dS_{t-1} = Diag(a) dS'
// and after the document's first token, dS is the initial state's gradient.
template <typename T>
void kda_recurrent_backward(const KdaShape& s, const T* q, const T* k, const T* v, const T* g, const T* beta,
                            const T* h0, const T* dout, const T* dht, T* dq, T* dk, T* dv, T* dg, T* dbeta, T* dh0) {
  const int64_t nk = s.dk, nv = s.dv, work = s.num_seqs * s.heads, size = nk * nv;
  const T scale = static_cast<T>(s.scale);
#pragma omp parallel
  {
    // states[r] holds S_{t-1} for the block's r-th token, states[r + 1] its S_t.
    std::vector<T> checkpoints, states((kBlock + 1) * size), decayed(size), ds(size), miss(nv), delta(nv), dd(nv);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < work; ++item) {
      const int64_t seq = item / s.heads, h = item % s.heads;
      const int64_t begin = s.cu_seqlens[seq], end = s.cu_seqlens[seq + 1];
      const int64_t blocks = (end - begin + kBlock - 1) / kBlock;
      // Forward once, keeping the state before each block.
      checkpoints.assign(static_cast<size_t>(std::max<int64_t>(blocks, 1) * size), T(0));
      if (h0) std::copy(h0 + kda_state(s, seq, h), h0 + kda_state(s, seq, h) + size, checkpoints.begin());
      std::vector<T>& state = decayed;  // scratch until the reverse pass
      std::copy(checkpoints.begin(), checkpoints.begin() + size, state.begin());
      for (int64_t t = begin; t < end; ++t) {
        if ((t - begin) % kBlock == 0) std::copy(state.begin(), state.end(), checkpoints.begin() + (t - begin) / kBlock * size);
        const int64_t r = kda_row(s, t, h);
        step(s, state.data(), k + r * nk, v + r * nv, g + r * nk, beta[r], state.data(), miss.data(), delta.data(),
             state.data());
      }

      if (dht)
        std::copy(dht + kda_state(s, seq, h), dht + kda_state(s, seq, h) + size, ds.begin());
      else
        std::fill(ds.begin(), ds.end(), T(0));
      for (int64_t b = blocks - 1; b >= 0; --b) {
        const int64_t first = begin + b * kBlock, last = std::min(end, first + kBlock);
        std::copy(checkpoints.begin() + b * size, checkpoints.begin() + (b + 1) * size, states.begin());
        for (int64_t t = first; t < last; ++t) {
          const int64_t r = kda_row(s, t, h);
          T* prev = states.data() + (t - first) * size;
          step(s, prev, k + r * nk, v + r * nv, g + r * nk, beta[r], prev + size, miss.data(), delta.data(), prev + size);
        }
        for (int64_t t = last - 1; t >= first; --t) {
          const int64_t r = kda_row(s, t, h);
          const T *qt = q + r * nk, *kt = k + r * nk, *gt = g + r * nk, *dot = dout + r * nv;
          const T* cur = states.data() + (t - first + 1) * size;
          const T bt = beta[r];
          // Recompute S', w and d of this step from S_{t-1}.
          step(s, cur - size, kt, v + r * nv, gt, bt, decayed.data(), miss.data(), delta.data(), static_cast<T*>(nullptr));
          // Output.
          for (int64_t i = 0; i < nk; ++i) {
            T acc = 0;
            for (int64_t j = 0; j < nv; ++j) {
              acc += cur[i * nv + j] * dot[j];
              ds[i * nv + j] += scale * qt[i] * dot[j];
            }
            dq[r * nk + i] = scale * acc;
          }
          // The correction d and beta.
          std::fill(dd.begin(), dd.end(), T(0));
          for (int64_t i = 0; i < nk; ++i)
            for (int64_t j = 0; j < nv; ++j) dd[j] += ds[i * nv + j] * kt[i];
          T db = 0;
          for (int64_t j = 0; j < nv; ++j) {
            db += dd[j] * miss[j];
            dd[j] *= bt;  // now dw
            dv[r * nv + j] = dd[j];
          }
          dbeta[r] = db;
          // k (through k d^T and S'^T k), then dS' = dS - k dw^T, g and dS_{t-1}.
          for (int64_t i = 0; i < nk; ++i) {
            T acc = 0, dgi = 0;
            const T a = std::exp(gt[i]);
            for (int64_t j = 0; j < nv; ++j) {
              acc += ds[i * nv + j] * delta[j] - decayed[i * nv + j] * dd[j];
              const T dsp = ds[i * nv + j] - kt[i] * dd[j];
              dgi += decayed[i * nv + j] * dsp;
              ds[i * nv + j] = a * dsp;
            }
            dk[r * nk + i] = acc;
            dg[r * nk + i] = dgi;
          }
        }
      }
      if (dh0) std::copy(ds.begin(), ds.end(), dh0 + kda_state(s, seq, h));
    }
  }
}

#define KILN_KDA_RECURRENT(T)                                                                                        \
  template void kda_recurrent_forward<T>(const KdaShape&, const T*, const T*, const T*, const T*, const T*,          \
                                         const T*, T*, T*);                                                          \
  template void kda_recurrent_backward<T>(const KdaShape&, const T*, const T*, const T*, const T*, const T*,         \
                                          const T*, const T*, const T*, T*, T*, T*, T*, T*, T*);
KILN_KDA_RECURRENT(float)
KILN_KDA_RECURRENT(double)
#undef KILN_KDA_RECURRENT

}  // namespace kiln::cpu

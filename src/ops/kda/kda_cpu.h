// CPU kernels of KDA (kda.h): pointers and sizes, templated on float / double. One work
// item per (sequence, head): the state of a head in a document is independent of every
// other, so items run in parallel and write disjoint rows.
#pragma once

#include <cstdint>

namespace kiln::cpu {

struct KdaShape {
  int64_t tokens, heads, dk, dv, num_seqs;
  const int32_t* cu_seqlens;
  double scale;
  int64_t chunk;  // the chunked forms' chunk length
};

// Row offsets of token t, head h in the [N, H, d] layouts and of (s, h) in the states.
inline int64_t kda_row(const KdaShape& s, int64_t t, int64_t h) { return t * s.heads + h; }
inline int64_t kda_state(const KdaShape& s, int64_t seq, int64_t h) { return (seq * s.heads + h) * s.dk * s.dv; }

// h0 and ht may be null (zero start / not written).
template <typename T>
void kda_recurrent_forward(const KdaShape& s, const T* q, const T* k, const T* v, const T* g, const T* beta,
                           const T* h0, T* out, T* ht);

template <typename T>
void kda_chunked_forward(const KdaShape& s, const T* q, const T* k, const T* v, const T* g, const T* beta,
                         const T* h0, T* out, T* ht);

// dht and dh0 may be null.
template <typename T>
void kda_recurrent_backward(const KdaShape& s, const T* q, const T* k, const T* v, const T* g, const T* beta,
                            const T* h0, const T* dout, const T* dht, T* dq, T* dk, T* dv, T* dg, T* dbeta, T* dh0);

// The same gradients by chunks of s.chunk tokens per document (kda_chunked.cpp).
template <typename T>
void kda_chunked_backward(const KdaShape& s, const T* q, const T* k, const T* v, const T* g, const T* beta,
                          const T* h0, const T* dout, const T* dht, T* dq, T* dk, T* dv, T* dg, T* dbeta, T* dh0);

}  // namespace kiln::cpu

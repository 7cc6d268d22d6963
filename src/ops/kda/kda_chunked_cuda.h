// The chunked KDA kernels (kda_chunked_*.cu): the WY form of kda_chunked.cpp on the GPU,
// so that the work inside a chunk runs in parallel over every chunk of the batch and only
// the state's hand-over from chunk to chunk is sequential (a walk of 64-token steps per
// document instead of the recurrent kernels' one-token steps).
//
// Layout and dtypes as kda_cuda.h (KdaArgs). The chunk is kKdaChunk tokens (a document's
// last chunk may be shorter) and d_k at most kKdaChunkedMaxDk: the per-chunk gradient
// kernel keeps four [chunk, d_k] fp32 tiles in shared memory. Both directions take an f32
// workspace of kda_chunked_workspace_elems floats (the chunks' factors, entering states
// and, for the backward, their gradients); nothing is kept from forward to backward (the
// backward recomputes the factors). No atomics: every run gives the same bits.
#pragma once

#include "ops/kda/kda_cuda.h"

namespace kiln::cuda {

constexpr int64_t kKdaChunk = 64;
constexpr int64_t kKdaChunkedMaxDk = 128;

// Shapes only; the same for the forward and the backward.
int64_t kda_chunked_workspace_elems(int64_t tokens, int64_t heads, int64_t dk, int64_t dv, int64_t num_seqs);

// h0, ht null: zero start / not written.
void kda_chunked_forward(const ExecContext& ctx, const KdaArgs& a, const void* q, const void* k, const void* v,
                         const void* g, const void* beta, const float* h0, void* out, float* ht, float* workspace);

// dht, dh0 null: zero / not written.
void kda_chunked_backward(const ExecContext& ctx, const KdaArgs& a, const void* q, const void* k, const void* v,
                          const void* g, const void* beta, const float* h0, const void* dout, const float* dht,
                          void* dq, void* dk, void* dv, void* dg, void* dbeta, float* dh0, float* workspace);

}  // namespace kiln::cuda

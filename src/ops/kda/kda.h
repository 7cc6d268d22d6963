// Kimi Delta Attention (KDA): the gated delta rule with a channel-wise decay, over packed
// variable-length sequences. Per head, a state S [d_k, d_v] runs through each document:
//   S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T
//   o_t = scale * S_t^T q_t                                  (scale 0 = 1/sqrt(d_k))
// q, k, g [N, H, d_k] (q and k L2-normalized upstream, g = log decay <= 0), v, o
// [N, H, d_v], beta [N, H] in (0, 1). Sequence s spans rows [cu_seqlens[s],
// cu_seqlens[s+1]) (i32 [S+1]); the state starts at initial_state[s] (or zero) at each
// document's start, so documents never share state, and final_state [S, H, d_k, d_v]
// receives the state after its last token (what decode continues from).
//
// CPU: f32 or f64, accumulated in the input's type. Two forwards and two backwards: the
// token-by-token recurrence (the oracle) and the chunked WY form the fast GPU kernel will
// follow (kda_chunked.cpp has the math of both directions). The "kda" token mixer
// (nn/kda_mixer.h) trains on the chunked form and decodes on the recurrent one.
//
// GPU: both forms. The recurrent kernels (ops/kda/kda_cuda.h: d_k <= 256; the backward
// takes an f32 workspace of kda_backward_workspace(...) elements) and the chunked ones
// (ops/kda/kda_chunked_cuda.h: chunk 64, d_k <= 128; forward and backward take an f32
// workspace of kda_chunked_workspace(...) elements). q, k, v, g, beta, out and the
// gradients f32 or bf16 (fp32 math, results stored in the input dtype), the states and
// their gradients f32, cu_seqlens i32 on the device (its values are trusted, not read back).
#pragma once

#include "core/exec_context.h"
#include "core/tensor.h"

namespace kiln::ops {

struct KdaOptions {
  double scale = 0;     // 0 = 1/sqrt(d_k)
  int64_t chunk = 64;   // the chunked forward's and backward's chunk length (tokens, within a document)
  // The chunked GPU kernels' state columns per block of their sequential kernels: 8, 16 or
  // 32; 0 = chosen at launch from the blocks the batch gives and the card's SMs. Tests and
  // `kiln bench-kda` force each; the results are the same bits whatever it is.
  int gpu_slice = 0;
  // The chunked GPU kernels' chunk products on TF32 tensor cores where they apply (bf16
  // inputs, d_k and d_v multiples of 16); false keeps them in fp32 SIMT, as the fp32 inputs'
  // are. Tests compare both.
  bool gpu_tensor_cores = true;
  // The chunked backward's per-chunk gradients on bf16 tensor cores (grads_bf16_kernel,
  // model.kda.gpu_kernel = "chunked_bf16") where they apply (as gpu_tensor_cores); false keeps
  // grads_tf32_kernel.
  bool gpu_bf16_grads = false;
};

// out (=); initial_state and final_state may be undefined (zero start / not written).
void kda_recurrent_forward(const ExecContext& ctx, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                           const Tensor& beta, const Tensor& cu_seqlens, const Tensor& initial_state,
                           const KdaOptions& options, const Tensor& out, const Tensor& final_state = Tensor());

// The same outputs by chunks of options.chunk tokens per document (kda_chunked.cpp; 64 on
// the GPU, whose workspace is required there and ignored on the CPU).
void kda_chunked_forward(const ExecContext& ctx, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                         const Tensor& beta, const Tensor& cu_seqlens, const Tensor& initial_state,
                         const KdaOptions& options, const Tensor& out, const Tensor& final_state = Tensor(),
                         const Tensor& workspace = Tensor());

// From dout (and d_final_state, the gradient of final_state; undefined = zero):
// dq, dk, dv, dg, dbeta (=) and d_initial_state (=, skipped if undefined). The states are
// recomputed from the inputs (kda_recurrent.cpp), nothing is saved by the forward.
void kda_recurrent_backward(const ExecContext& ctx, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                            const Tensor& beta, const Tensor& cu_seqlens, const Tensor& initial_state,
                            const Tensor& dout, const Tensor& d_final_state, const KdaOptions& options, const Tensor& dq,
                            const Tensor& dk, const Tensor& dv, const Tensor& dg, const Tensor& dbeta,
                            const Tensor& d_initial_state = Tensor(), const Tensor& workspace = Tensor());

// The same gradients by chunks of options.chunk tokens per document (kda_chunked.cpp), as
// flash-linear-attention's chunk_kda backward: a forward pass keeps the state entering each
// chunk, then the chunks run in reverse, carrying the state's gradient from chunk to chunk
// and differentiating each chunk through its WY factors (the GPU's workspace as the forward's).
void kda_chunked_backward(const ExecContext& ctx, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                          const Tensor& beta, const Tensor& cu_seqlens, const Tensor& initial_state,
                          const Tensor& dout, const Tensor& d_final_state, const KdaOptions& options, const Tensor& dq,
                          const Tensor& dk, const Tensor& dv, const Tensor& dg, const Tensor& dbeta,
                          const Tensor& d_initial_state = Tensor(), const Tensor& workspace = Tensor());

// f32 elements of the chunked GPU kernels' workspace (the same for both directions: per
// 64-token chunk and head its factors, entering state and their gradients); depends on
// shapes only; 0 without CUDA. The largest d_k they take is kda_chunked_max_dk().
int64_t kda_chunked_workspace(int64_t tokens, int64_t heads, int64_t dk, int64_t dv, int64_t num_seqs);
int64_t kda_chunked_max_dk();

// f32 elements of kda_recurrent_backward's GPU workspace (checkpointed states every 64
// tokens, per-d_v-slice partial sums); depends on shapes only; 0 without CUDA. The CPU
// path takes no workspace.
int64_t kda_backward_workspace(int64_t tokens, int64_t heads, int64_t dk, int64_t dv, int64_t num_seqs);

}  // namespace kiln::ops

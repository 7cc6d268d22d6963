// Decoder: the inference path of a Model with a KV cache. It drives the model's own
// components through their decode entries (nn/decode.h): each block's norms, token mixer
// and MLP, the final norm and the LM head make decoder objects for this decoder, which
// plan their decode state (attention's KV cache, a recurrent mixer's fixed-size state) in
// the decoder's arena and choose their kernels (fused or not) once, here. Nothing here
// knows what a component computes.
//
// One forward() runs a "step" of up to max_rows rows, each a (token, slot, position):
// prefill chunks of one or several prompts and single decode tokens of many sequences mix
// freely. Each row's state (K/V) is written at (slot, position) and its query attends to
// that slot's positions 0..position. Every buffer is planned at construction and allocated
// once: shapes are static and nothing allocates per step.
//
// The decoder computes in the model's compute dtype: a model built in bf16 on the GPU (the
// mixed path: bf16 weight copies, fp32 masters, gains and residual stream) decodes in bf16
// with bf16 activations and cache and fp32 logits; an f32 or f64 model in its dtype. With
// the fused kernels (DecoderOptions::fuse) the components replace runs of ops with one
// kernel each (q/k norm + RoPE + cache write; residual add + the next RMSNorm), and steps
// of at most gemv_rows rows that compute their logits (the captured decode steps) run
// whole branches on the fused decode projections, the attention of distinct sequences as
// one kernel (ops/decode/decode_kernels.h). A step of at most graph_rows rows (a decode
// step) is a CUDA graph: the first step of each row count (and kind: distinct sequences
// or not) runs as is (the warm-up), is then captured on the decoder's stream, and later
// steps of that count upload their inputs into the same device buffers and replay it. A
// captured step also computes the logits of all its rows, so logits() and greedy() only
// copy them out.
#pragma once

#include "core/arena.h"
#include "core/device_memory.h"
#include "model/model.h"

#include <memory>
#include <span>
#include <utility>
#include <vector>

namespace kiln {

namespace cuda {
class StepGraphs;
}  // namespace cuda

class AttnResDecoder;  // nn/attn_res_decode.h

struct DecoderOptions {
  int64_t slots = 8;        // sequences held in the cache at once
  int64_t max_len = 0;      // positions per slot; 0 = model.max_seq_len (never more)
  int64_t max_rows = 256;   // rows of one forward (prefill chunk + decode tokens)
  int64_t logit_rows = 64;  // rows of logits computed at once
  // On the GPU, steps of at most this many rows run as CUDA graphs (capped at max_rows
  // and logit_rows); 0 = never.
  int64_t graph_rows = 16;
  // On the GPU, the components' fused kernels (the q/k norm + RoPE + cache write, each
  // residual add + the next RMSNorm); false runs every component on its ops one by one,
  // which is what the fused kernels are checked against.
  bool fuse = true;
  // With the fused kernels on the bf16 path, steps of at most this many rows (up to 8) that
  // compute their logits (the captured decode steps) run whole branches on the fused
  // decode projections (RMSNorm, residual adds and SwiGLU folded into skinny products)
  // where the branch has them; 0 keeps every step on linear_forward and the separate
  // kernels, what the fused projections are checked against. 8: on the tensor-core kernel
  // a step of 8 rows costs about what one of 4 does (measured on the H200,
  // docs/performance.md, decoding).
  int64_t gemv_rows = 8;
  // Those steps, when their rows are distinct sequences, also run each attention's q/k
  // norm, RoPE, cache write and attention as one kernel; false keeps them on the three
  // kernels of the other steps, what the one kernel is checked against.
  bool one_kernel_attention = true;
  int64_t chain_steps = 64;  // most steps one greedy_chain() call may run
};

class Decoder {
 public:
  // The model must outlive the decoder (its weights are viewed, not copied); its compute
  // copies are refreshed from the masters here, so train between decoders, not during one.
  Decoder(Model& model, const DecoderOptions& options);
  ~Decoder();
  Decoder(const Decoder&) = delete;
  Decoder& operator=(const Decoder&) = delete;

  int64_t slots() const { return options_.slots; }
  int64_t max_len() const { return options_.max_len; }
  int64_t max_rows() const { return options_.max_rows; }
  int64_t vocab_size() const { return config_.vocab_size; }
  const ModelConfig& config() const { return config_; }
  DType dtype() const { return dtype_; }  // compute dtype (bf16 on the GPU's mixed path)
  Device device() const { return device_; }
  // Everything the decoder allocated: its state (caches), activations and scratch.
  size_t memory_bytes() const { return arena_.planned_bytes() + workspace_.planned_bytes(); }
  // The components' decode state (the KV caches), the part of memory_bytes() that grows
  // with slots x max_len.
  size_t state_bytes() const { return state_bytes_; }
  // Bytes of weights a step reads whatever its rows: every block's weights, the final
  // norm and the LM head, in the dtype read (the embedding table only by its rows: not
  // counted). The memory-bandwidth floor of a decode step is this over the bandwidth.
  size_t weight_bytes() const { return weight_bytes_; }
  // Row counts whose step has been captured as a CUDA graph so far.
  size_t graphs() const;

  // Runs rows i = 0..n-1 (n = tokens.size() <= max_rows): token tokens[i] of slot slots[i]
  // at position positions[i]. Positions below it in that slot must already be in the cache.
  void forward(std::span<const int32_t> tokens, std::span<const int32_t> slots, std::span<const int32_t> positions);
  // Logits of the given rows of the last forward, host f32 row-major [rows.size(), V].
  void logits(std::span<const int32_t> rows, std::vector<float>& out);
  // The greedy next token of the given rows of the last forward (the lowest id among equal
  // maxima, as the sampler's greedy pick); on the GPU the argmax runs on the device.
  void greedy(std::span<const int32_t> rows, std::vector<int32_t>& out);
  // Greedy decoding of `steps` tokens (1 to chain_steps) for every row of the last forward,
  // which must be a decode step (rows of distinct sequences): out[s * rows + i] is row i's
  // token after s more steps, out[i] what greedy() would return now. Each token but the
  // last is fed back as the row's next input at the next position (the cache grows by
  // steps - 1 positions per sequence; the last token, as greedy()'s, is not in it yet). On
  // the GPU the ids feed back on the device, so the host enqueues all the steps without
  // waiting for any and copies the ids back once: no round trip per token.
  void greedy_chain(int64_t steps, std::vector<int32_t>& out);
  // Copies slot `from`'s decode state after its first `positions` rows into slot `to`, in
  // every layer (cached positions; a fixed-size state whole): `to` then continues as if
  // it had run those rows itself, bit for bit, without running them (a prompt prefilled
  // once for several sequences). Between forwards only.
  void copy_slot(int32_t from, int32_t to, int64_t positions);
  // A new sequence starts in `slot` (a finished one's slot reused, or a first use): every
  // layer's fixed-size decode state of that slot starts again from zero (a KV cache needs
  // nothing, its positions are overwritten). Call it before the slot's first row, between
  // forwards; a new decoder's slots are all fresh.
  void reset_slot(int32_t slot);

 private:
  void check_rows(std::span<const int32_t> rows) const;
  void step(int64_t n, bool with_logits);
  Tensor compute_logits(std::span<const int32_t> rows);

  Model& model_;
  ModelConfig config_;
  DecoderOptions options_;
  Device device_;
  DType dtype_;        // compute dtype: activations, cache, the weights GEMMs read
  DType wide_;         // residual stream, gains, statistics, logits
  int64_t graph_rows_; // steps of at most this many rows are CUDA graphs (0 = none)
  int64_t fused_branch_rows_ = 0;  // steps of at most this many rows with logits fuse whole branches
  bool distinct_slots_ = false;    // the rows of the current step are distinct sequences
  ExecContext exec_;  // where its ops run and its steps are captured (core/exec_context.h)
  Arena arena_;
  Workspace workspace_;
  // The components' decoders, in the model's order.
  std::vector<std::unique_ptr<BlockDecoder>> blocks_;
  std::unique_ptr<AttnResDecoder> attn_res_;  // model.attn_res_block > 0, else null
  std::unique_ptr<NormDecoder> final_norm_;
  std::unique_ptr<HeadDecoder> head_;
  Tensor embed_;       // the embedding's master: rows looked up into the wide residual stream
  size_t weight_bytes_ = 0, state_bytes_ = 0;
  // Step inputs: i32 [3, max_rows] = tokens, slots, positions (one upload per step), staged
  // on the host in host_inputs_.
  Tensor inputs_, tokens_, slots_, positions_;
  std::vector<int32_t> host_inputs_;
  std::vector<int32_t> sorted_slots_;  // a step's slots, sorted (to find repeats), max_rows reserved
  Tensor x_, h_, branch_;                   // [max_rows, hidden]: residual (wide), normed and branch (compute)
  Tensor gather_, logits_;                  // [logit_rows, hidden], [logit_rows, V]
  Tensor argmax_;                           // i32 [logit_rows] greedy ids (GPU)
  Tensor chain_;                            // i32 greedy_chain's ids [chain_steps, graph_rows] + a step counter (GPU)
  OwnedTensor host_logits_;                 // staging when logits are not host f32
  PinnedArray<int32_t> host_chain_;        // greedy_chain's ids copied back (GPU)
  PinnedArray<int32_t> host_argmax_;       // greedy ids copied back (GPU; allocated on first use)
  // Made in CUDA builds only; a shared_ptr because its deleter is bound where it is made,
  // so CPU builds (without the .cu that defines StepGraphs) never reference one.
  std::shared_ptr<cuda::StepGraphs> graphs_;
  int64_t rows_ = 0;
  int64_t logits_ready_ = 0;                // the last step computed logits of rows [0, this)
};

}  // namespace kiln

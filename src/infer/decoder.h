// Decoder: the inference path of a trained Model with a KV cache, built from the model's
// parameters (looked up by name) and the ops' front ends, never from the training modules.
//
// One forward() runs a "step" of up to max_rows rows, each a (token, slot, position):
// prefill chunks of one or several prompts and single decode tokens of many sequences mix
// freely. Each row's K/V is written into the cache at (slot, position) and its query attends
// to that slot's positions 0..position. Every buffer (activations, cache, RoPE tables) is
// planned at construction and allocated once: shapes are static and nothing allocates per
// step. All math goes through ops::* front ends, which pick the CPU reference or a CUDA
// kernel by device.
//
// On the GPU the decoder computes in bf16 by default (the mixed path of
// ops/mixed_precision.h): it converts the model's fp32 weights once into its own bf16
// copies of the rank-2 weights (norm gains, biases and the embedding table it looks rows
// up in stay fp32), keeps the residual stream fp32, activations and the cache bf16, and
// writes fp32 logits. Two fused kernels (q/k norm + RoPE + cache write; residual add +
// the next RMSNorm) stand in for runs of ops there, since at decode batch sizes a step's
// small kernels cost their count; captured decode steps go further (five kernels per
// block: the projections with their norms, residual adds and SwiGLU folded in, and one
// kernel for the attention; see DecoderOptions::gemv_rows and one_kernel_attention). A
// step of at most graph_rows rows (a decode step) is a CUDA graph: the first step of each
// row count (and kind: distinct sequences or not) runs as is (the warm-up), is then
// captured on kiln::cuda::stream(), and later steps of that count upload their inputs into
// the same device buffers and replay it. A captured step also computes the logits of all
// its rows, so logits() and greedy() only copy them out.
//
// Supported components: norm rmsnorm; attention gqa (optional qk_norm, q/k/v bias);
// mlp swiglu; position rope or none. Anything else is refused by name at construction.
#pragma once

#include "core/arena.h"
#include "core/device_memory.h"
#include "infer/kv_cache.h"
#include "model/model.h"

#include <memory>
#include <span>
#include <utility>
#include <vector>

namespace kiln {

namespace cuda {
class StepGraphs;
struct DecodeAttentionArgs;
}

struct DecoderOptions {
  int64_t slots = 8;        // sequences held in the cache at once
  int64_t max_len = 0;      // positions per slot; 0 = model.max_seq_len (never more)
  int64_t max_rows = 256;   // rows of one forward (prefill chunk + decode tokens)
  int64_t logit_rows = 64;  // rows of logits computed at once
  // Compute dtype on the GPU: bf16 (the mixed path described above) or f32. The CPU
  // computes in the model's dtype.
  DType cuda_dtype = DType::bf16;
  // On the GPU, steps of at most this many rows run as CUDA graphs (capped at max_rows
  // and logit_rows); 0 = never.
  int64_t graph_rows = 16;
  // On the GPU, fused kernels for the q/k norm + RoPE + cache write and for each residual
  // add + the next RMSNorm (infer/decoder_cuda.h); false runs the ops one by one, which
  // is what the fused kernels are checked against.
  bool fuse = true;
  // With the fused kernels on the bf16 path, steps of at most this many rows (up to 8) that
  // compute their logits (the captured decode steps) run the fused projections of
  // infer/decoder_cuda.h (RMSNorm, residual adds and SwiGLU folded into skinny products); 0
  // keeps every step on linear_forward and the separate kernels, what the fused projections
  // are checked against. 8: on the tensor-core kernel a step of 8 rows costs about what
  // one of 4 does (measured on the H200, docs/performance.md, decoding).
  int64_t gemv_rows = 8;
  // Those steps, when their rows are distinct sequences, also run each block's q/k norm,
  // RoPE, cache write and attention as one kernel (infer/decode_attention.cu); false keeps
  // them on the three kernels of the other steps, what the one kernel is checked against.
  bool one_kernel_attention = true;  // Most steps one greedy_chain() call may run.
  int64_t chain_steps = 64;
};

class Decoder {
 public:
  // The model must outlive the decoder (its weights are viewed, not copied).
  Decoder(const Model& model, const DecoderOptions& options);
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
  // Everything the decoder allocated: activations, cache, tables and its weight copies.
  size_t memory_bytes() const { return arena_.planned_bytes(); }
  // Bytes of weights a step reads whatever its rows: every block's weights, the final
  // norm and the LM head, in the dtype read (the embedding table only by its rows: not
  // counted). The memory-bandwidth floor of a decode step is this over the bandwidth.
  size_t weight_bytes() const { return weight_bytes_; }
  const KvCache& cache() const { return *cache_; }
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

 private:
  struct Layer;
  Tensor lookup(const std::string& name) const;
  Tensor fused(const std::vector<std::string>& names);
  void compute_weight(const Tensor& master, Tensor& dst);
  void check_rows(std::span<const int32_t> rows) const;
  void step(int64_t n, bool with_logits);
  void step_fused(int64_t n, bool with_logits);
  void step_gemv(int64_t n);
  void attend(size_t layer, int64_t n);
  cuda::DecodeAttentionArgs attention_args(size_t layer, int64_t n) const;
  Tensor compute_logits(std::span<const int32_t> rows);

  const Model& model_;
  ModelConfig config_;
  DecoderOptions options_;
  Device device_;
  DType dtype_;        // compute dtype: activations, cache, the weights GEMMs read
  DType wide_;         // residual stream, gains, RoPE tables, statistics, logits
  bool mixed_;         // dtype_ narrower than wide_ (bf16 on the GPU)
  bool fused_;         // the GPU's fused kernels (DecoderOptions::fuse)
  int64_t graph_rows_; // steps of at most this many rows are CUDA graphs (0 = none)
  int64_t gemv_rows_ = 0;  // steps of at most this many rows with logits run step_gemv (0 = none)
  bool one_kernel_attention_ = false;  // step_gemv's attention is infer/decode_attention.cu's kernel
  bool distinct_slots_ = false;        // the rows of the current step are distinct sequences
  Arena arena_;
  std::vector<std::unique_ptr<OwnedTensor>> copies_;  // fused weights whose parts were not adjacent
  std::vector<std::pair<Tensor, Tensor*>> to_convert_;  // (master, its compute copy) until allocated
  std::unique_ptr<KvCache> cache_;
  std::vector<std::unique_ptr<Layer>> layers_;
  Tensor embed_, final_norm_, head_;
  size_t weight_bytes_ = 0;
  // Step inputs: i32 [3, max_rows] = tokens, slots, positions (one upload per step), staged
  // on the host in host_inputs_.
  Tensor inputs_, tokens_, slots_, positions_;
  std::vector<int32_t> host_inputs_;
  std::vector<int32_t> sorted_slots_;  // a step's slots, sorted (to find repeats), max_rows reserved
  // Activations, [max_rows, ...].
  Tensor x_, h_, rstd_, qkv_, q_, k_, v_, qn_, kn_, qk_rstd_, attn_, branch_, gate_up_, act_;
  Tensor attn_workspace_;                   // f32 split partials of cached attention (GPU)
  Tensor cos_, sin_;                        // RoPE tables [max_len, head_dim / 2]
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

// Decoder: the inference path of a trained Model with a KV cache, built from the model's
// parameters (looked up by name) and the ops' front ends, never from the training modules.
//
// One forward() runs a "step" of up to max_rows rows, each a (token, slot, position):
// prefill chunks of one or several prompts and single decode tokens of many sequences mix
// freely. Each row's K/V is written into the cache at (slot, position) and its query attends
// to that slot's positions 0..position. Every buffer (activations, cache, RoPE tables) is
// planned at construction and allocated once: shapes are static and nothing allocates per
// step. All math goes through ops::* front ends, which pick the CPU reference or a CUDA
// kernel by device, so a CUDA decoder (and CUDA-graph capture of the step) is this class on
// a CUDA model once the kernels exist (ops/attention/cached_attention.h is the new one).
//
// Supported components: norm rmsnorm; attention gqa (optional qk_norm, q/k/v bias);
// mlp swiglu; position rope or none. Anything else is refused by name at construction.
#pragma once

#include "core/arena.h"
#include "infer/kv_cache.h"
#include "model/model.h"

#include <memory>
#include <span>
#include <vector>

namespace kiln {

struct DecoderOptions {
  int64_t slots = 8;        // sequences held in the cache at once
  int64_t max_len = 0;      // positions per slot; 0 = model.max_seq_len (never more)
  int64_t max_rows = 256;   // rows of one forward (prefill chunk + decode tokens)
  int64_t logit_rows = 64;  // rows of logits computed at once
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
  size_t memory_bytes() const { return arena_.planned_bytes(); }
  const KvCache& cache() const { return *cache_; }

  // Runs rows i = 0..n-1 (n = tokens.size() <= max_rows): token tokens[i] of slot slots[i]
  // at position positions[i]. Positions below it in that slot must already be in the cache.
  void forward(std::span<const int32_t> tokens, std::span<const int32_t> slots, std::span<const int32_t> positions);
  // Logits of the given rows of the last forward, host f32 row-major [rows.size(), V].
  void logits(std::span<const int32_t> rows, std::vector<float>& out);

 private:
  struct Layer;
  Tensor lookup(const std::string& name) const;
  Tensor fused(const std::vector<std::string>& names);

  const Model& model_;
  ModelConfig config_;
  DecoderOptions options_;
  Arena arena_;
  std::vector<std::unique_ptr<OwnedTensor>> copies_;  // fused weights whose parts were not adjacent
  std::unique_ptr<KvCache> cache_;
  std::vector<std::unique_ptr<Layer>> layers_;
  Tensor embed_, final_norm_, head_;
  // Step inputs and activations, [max_rows, ...].
  Tensor tokens_, slots_, positions_;
  Tensor x_, h_, rstd_, qkv_, q_, k_, v_, qn_, kn_, qk_rstd_, attn_, branch_, gate_up_, act_;
  Tensor cos_, sin_;                        // RoPE tables [max_len, head_dim / 2]
  Tensor gather_, logits_;                  // [logit_rows, hidden], [logit_rows, V]
  OwnedTensor host_logits_;                 // staging when logits are not host f32
  int64_t rows_ = 0;
};

}  // namespace kiln

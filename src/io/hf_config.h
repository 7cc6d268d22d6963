// kiln's model <-> a Hugging Face config.json of a stock architecture.
//
// Export picks the one stock family that can compute the model, and the model's components
// write its fields (nn/export_config.h), each refusing, by its config key, what the family
// cannot express:
//   sparse layers (mlp "moe")   -> Qwen3MoeForCausalLM (model_type "qwen3_moe": softmax_topk
//                                  routing, q/k norms, no shared expert; dense layers as
//                                  mlp_only_layers)
//   ... routed by sigmoid_bias  -> Dots1ForCausalLM (model_type "dots1", dots.llm1: Qwen3's
//                                  attention with DeepSeek-V3's router, shared experts and
//                                  the dense layers first; nn/moe/moe_export.cpp)
//   sandwich_norms, qk_norm on  -> Gemma3ForCausalLM (model_type "gemma3_text": Gemma's
//                                  norms, sandwiched; q/k norms; local and global RoPE bases)
//   sandwich_norms, qk_norm off -> Gemma2ForCausalLM (model_type "gemma2": Gemma's norms,
//                                  sandwiched; softcaps; the embedding x sqrt(hidden))
//   qk_norm on                  -> Qwen3ForCausalLM  (model_type "qwen3")
//   qk_norm off, q/k/v bias     -> Qwen2ForCausalLM  (model_type "qwen2")
//   qk_norm off, no bias        -> LlamaForCausalLM  (model_type "llama"; head_dim written
//                                  explicitly, so head_dim may differ from hidden / heads)
// The Qwen/Llama families: RMSNorm, a gated MLP, RoPE by rotate_half with one theta, causal
// attention (windowed per layer in Qwen2/3), and the same eps, vocabulary and tying.
// Import reads those model types back and refuses any field kiln cannot compute
// (rope scaling, sliding windows, o_proj / MLP biases, another activation).
#pragma once

#include "config/config.h"
#include "model/model.h"

#include <nlohmann/json.hpp>

#include <map>
#include <optional>
#include <string>
#include <string_view>

namespace kiln::io {

enum class HfArch { qwen3, llama, qwen2, qwen3_moe, dots1, gemma2, gemma3 };

// Gemma 2 or 3: the families of sandwich norms (their own config fields, io/hf_config.cpp).
inline bool is_gemma(HfArch arch) { return arch == HfArch::gemma2 || arch == HfArch::gemma3; }

std::string_view hf_model_type(HfArch arch);        // "qwen3"
std::string_view hf_architecture(HfArch arch);      // "Qwen3ForCausalLM"
std::string_view gguf_architecture(HfArch arch);    // llama.cpp's name: "qwen3", "qwen3moe", "dots1"

// The stock family that may represent `model` (its components then refuse what it cannot).
HfArch choose_hf_arch(const ModelConfig& model);

struct HfSpecialTokens {
  int64_t bos = -1, eos = -1, pad = -1;  // -1 = none
};

// config.json of `model` as `arch` (choose_hf_arch of its config); `dtype` is the stored
// weight type ("float32", "bfloat16", "float16"). Written for transformers 4.x and 5.x
// alike (rope_theta and rope_parameters; torch_dtype and dtype). Throws "[export] model.x =
// ...: ..." when a component cannot be expressed.
nlohmann::json hf_config_json(const Model& model, HfArch arch, const HfSpecialTokens& special,
                              std::string_view dtype);

struct HfModelSpec {
  HfArch arch = HfArch::qwen3;
  ModelConfig model;
  HfSpecialTokens special;
  std::string dtype;  // torch_dtype / dtype as written, "" if absent
};

// Reads a config.json (parsed); `where` names the file in errors. Throws naming the field
// when the model is not one kiln computes exactly.
HfModelSpec hf_config_to_model(const nlohmann::json& config, const std::string& where);

// The Config `kiln import hf` saves for `spec`: its model, with a micro-batch that holds one
// whole context (e.g. 40960 positions for Qwen3). Validated here, before any model is
// allocated (num_experts = 2^31 grew past 5 GB); an error names `where` and kiln's key.
Config hf_import_config(const HfModelSpec& spec, const std::string& where);

// model.safetensors.index.json's weight_map: tensor name -> shard, a file name inside the
// model's directory. Typed (a shard name that is not a string was nlohmann's type_error,
// naming nothing); `where` names the file in errors.
std::map<std::string, std::string> read_weight_map(const nlohmann::json& index, const std::string& where);

}  // namespace kiln::io

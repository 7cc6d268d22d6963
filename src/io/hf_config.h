// kiln's ModelConfig <-> a Hugging Face config.json of a stock architecture.
//
// Export picks the one stock class that computes exactly what kiln computes, and refuses
// (an error naming the config key) a model no stock class represents:
//   qk_norm on,  no q/k/v bias              -> Qwen3ForCausalLM  (model_type "qwen3")
//   qk_norm off, no q/k/v bias              -> LlamaForCausalLM  (model_type "llama"; head_dim
//                                              written explicitly, so head_dim may differ
//                                              from hidden / heads)
//   qk_norm off, bias on q/k/v only         -> Qwen2ForCausalLM  (model_type "qwen2")
//   qk_norm on and q/k/v bias               -> refused (Qwen3's attention_bias also biases o_proj)
// Every one of them: RMSNorm, SwiGLU (silu), RoPE by rotate_half with one theta, causal
// full attention (no sliding window), and the same eps, vocabulary and tying.
// Import reads those three model types back and refuses any field kiln cannot compute
// (rope scaling, sliding windows, o_proj / MLP biases, another activation).
#pragma once

#include "config/config.h"

#include <nlohmann/json.hpp>

#include <optional>
#include <string>
#include <string_view>

namespace kiln::io {

enum class HfArch { qwen3, llama, qwen2 };

std::string_view hf_model_type(HfArch arch);        // "qwen3"
std::string_view hf_architecture(HfArch arch);      // "Qwen3ForCausalLM"

// The stock class representing `model` exactly; throws "[export] model.x = ...: ..." if none.
HfArch choose_hf_arch(const ModelConfig& model);

struct HfSpecialTokens {
  int64_t bos = -1, eos = -1, pad = -1;  // -1 = none
};

// config.json for `arch` (which must be choose_hf_arch(model)); `dtype` is the stored
// weight type ("float32", "bfloat16", "float16"). Written for transformers 4.x and 5.x
// alike (rope_theta and rope_parameters; torch_dtype and dtype).
nlohmann::json hf_config_json(const ModelConfig& model, HfArch arch, const HfSpecialTokens& special,
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

}  // namespace kiln::io

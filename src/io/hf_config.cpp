#include "io/hf_config.h"

#include "core/error.h"

#include <cmath>

namespace kiln::io {

using nlohmann::json;

std::string_view hf_model_type(HfArch arch) {
  switch (arch) {
    case HfArch::qwen3: return "qwen3";
    case HfArch::llama: return "llama";
    case HfArch::qwen2: return "qwen2";
  }
  return "?";
}

std::string_view hf_architecture(HfArch arch) {
  switch (arch) {
    case HfArch::qwen3: return "Qwen3ForCausalLM";
    case HfArch::llama: return "LlamaForCausalLM";
    case HfArch::qwen2: return "Qwen2ForCausalLM";
  }
  return "?";
}

HfArch choose_hf_arch(const ModelConfig& m) {
  if (m.qk_norm) return HfArch::qwen3;
  return m.attention_bias ? HfArch::qwen2 : HfArch::llama;
}

json hf_config_json(const Model& model, HfArch arch, const HfSpecialTokens& special, std::string_view dtype) {
  const ModelConfig& m = model.config();
  json c;
  c["architectures"] = {std::string(hf_architecture(arch))};
  c["model_type"] = std::string(hf_model_type(arch));
  ExportConfig out(ExportConfig::Format::hf, std::string(hf_model_type(arch)), m.layers, c);
  model.backbone().export_config(out);
  model.head().export_config(out);
  c["use_cache"] = true;
  if (arch != HfArch::llama) c["max_window_layers"] = m.layers;  // no window on any layer
  if (special.bos >= 0) c["bos_token_id"] = special.bos;
  if (special.eos >= 0) c["eos_token_id"] = special.eos;
  if (special.pad >= 0) c["pad_token_id"] = special.pad;
  c["torch_dtype"] = std::string(dtype);
  c["dtype"] = std::string(dtype);
  c["kiln_model_name"] = m.name;
  return c;
}

namespace {

// Typed field access with a default; errors name the file and field.
template <typename T>
T get(const json& c, const char* key, T fallback, const std::string& where) {
  const auto it = c.find(key);
  if (it == c.end() || it->is_null()) return fallback;
  try {
    return it->get<T>();
  } catch (const json::exception&) {
    fail("import", "{}: field '{}' has the wrong type ({})", where, key, it->dump());
  }
}

template <typename T>
T require(const json& c, const char* key, const std::string& where) {
  KILN_CHECK(c.contains(key) && !c[key].is_null(), "import", "{}: missing field '{}'", where, key);
  return get<T>(c, key, T{}, where);
}

// rope_scaling / rope_parameters must describe plain RoPE; returns theta if given there.
std::optional<double> plain_rope(const json& c, const char* key, const std::string& where) {
  const auto it = c.find(key);
  if (it == c.end() || it->is_null()) return std::nullopt;
  KILN_CHECK(it->is_object(), "import", "{}: field '{}' must be an object, got {}", where, key, it->dump());
  const std::string type = it->value("rope_type", it->value("type", std::string("default")));
  KILN_CHECK(type == "default", "import", "{}: {}.rope_type = '{}': kiln computes plain RoPE only (no scaling)", where,
             key, type);
  if (it->contains("partial_rotary_factor"))
    KILN_CHECK((*it)["partial_rotary_factor"].get<double>() == 1.0, "import",
               "{}: {}.partial_rotary_factor != 1: kiln rotates the whole head", where, key);
  if (it->contains("rope_theta")) return (*it)["rope_theta"].get<double>();
  return std::nullopt;
}

}  // namespace

HfModelSpec hf_config_to_model(const json& c, const std::string& where) {
  KILN_CHECK(c.is_object(), "import", "{}: not a JSON object", where);
  const std::string type = get<std::string>(c, "model_type", "", where);
  HfModelSpec spec;
  if (type == "qwen3") {
    spec.arch = HfArch::qwen3;
  } else if (type == "llama") {
    spec.arch = HfArch::llama;
  } else if (type == "qwen2") {
    spec.arch = HfArch::qwen2;
  } else {
    fail("import", "{}: model_type '{}' is not one kiln imports (qwen3, llama, qwen2)", where, type);
  }
  KILN_CHECK(!c.contains("quantization_config"), "import", "{}: quantized checkpoints are not supported", where);
  const std::string act = get<std::string>(c, "hidden_act", "silu", where);
  KILN_CHECK(act == "silu", "import", "{}: hidden_act = '{}': kiln's MLP is SwiGLU (silu)", where, act);

  ModelConfig& m = spec.model;
  m.vocab_size = require<int64_t>(c, "vocab_size", where);
  m.hidden = require<int64_t>(c, "hidden_size", where);
  m.layers = require<int64_t>(c, "num_hidden_layers", where);
  m.heads = require<int64_t>(c, "num_attention_heads", where);
  m.kv_heads = get<int64_t>(c, "num_key_value_heads", m.heads, where);
  m.ffn_hidden = require<int64_t>(c, "intermediate_size", where);
  KILN_CHECK(m.heads > 0 && m.hidden > 0, "import", "{}: hidden_size and num_attention_heads must be positive", where);
  // Qwen3Config's head_dim defaults to 128; Llama/Qwen2 fall back to hidden / heads.
  m.head_dim = get<int64_t>(c, "head_dim", spec.arch == HfArch::qwen3 ? 128 : m.hidden / m.heads, where);
  m.max_seq_len = get<int64_t>(c, "max_position_embeddings", spec.arch == HfArch::llama ? 2048 : 32768, where);
  m.norm_eps = get<double>(c, "rms_norm_eps", 1e-6, where);
  m.tie_embeddings = get<bool>(c, "tie_word_embeddings", false, where);
  m.init_std = get<double>(c, "initializer_range", 0.02, where);
  m.norm = "rmsnorm";
  m.mlp = "swiglu";
  m.attention = "gqa";
  m.position = "rope";
  m.qk_norm = spec.arch == HfArch::qwen3;
  m.attention_bias = spec.arch == HfArch::qwen2;
  m.name = get<std::string>(c, "kiln_model_name", std::string(hf_model_type(spec.arch)) + "-import", where);

  double theta = get<double>(c, "rope_theta", 10000.0, where);
  if (auto t = plain_rope(c, "rope_scaling", where)) theta = *t;
  if (auto t = plain_rope(c, "rope_parameters", where)) theta = *t;
  m.rope_theta = theta;

  if (spec.arch != HfArch::qwen2)
    KILN_CHECK(!get<bool>(c, "attention_bias", false, where), "import",
               "{}: attention_bias = true biases o_proj too, which kiln's attention does not compute", where);
  KILN_CHECK(!get<bool>(c, "mlp_bias", false, where), "import", "{}: mlp_bias = true: kiln's MLP has no biases",
             where);
  KILN_CHECK(!get<bool>(c, "use_sliding_window", false, where), "import",
             "{}: use_sliding_window = true: kiln computes full causal attention", where);
  if (c.contains("layer_types") && c["layer_types"].is_array())
    for (const auto& t : c["layer_types"])
      KILN_CHECK(t == "full_attention", "import", "{}: layer_types has '{}': kiln computes full attention only", where,
                 t.dump());

  spec.special.bos = get<int64_t>(c, "bos_token_id", -1, where);
  spec.special.pad = get<int64_t>(c, "pad_token_id", -1, where);
  const auto eos = c.find("eos_token_id");
  if (eos != c.end() && eos->is_array() && !eos->empty()) {
    spec.special.eos = (*eos)[0].get<int64_t>();
  } else {
    spec.special.eos = get<int64_t>(c, "eos_token_id", -1, where);
  }
  spec.dtype = get<std::string>(c, "torch_dtype", get<std::string>(c, "dtype", "", where), where);
  return spec;
}

}  // namespace kiln::io

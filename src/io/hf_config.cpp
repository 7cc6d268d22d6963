#include "io/hf_config.h"

#include "core/error.h"
#include "core/json_field.h"
#include "core/printable.h"

#include <cmath>
#include <type_traits>

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
  const char* where = "export";
  auto refuse = [&](std::string_view key, const std::string& value, std::string_view why) {
    fail(where, "model.{} = {}: {}; no stock Hugging Face class (Qwen3, Llama, Qwen2) computes this model", key,
         value, why);
  };
  if (m.norm != "rmsnorm") refuse("norm", "'" + m.norm + "'", "stock classes use RMSNorm");
  if (m.mlp != "swiglu") refuse("mlp", "'" + m.mlp + "'", "stock classes use a SwiGLU (silu) MLP");
  if (m.attention != "gqa") refuse("attention", "'" + m.attention + "'", "stock classes use causal full attention");
  if (m.position != "rope") refuse("position", "'" + m.position + "'", "stock classes use rotary embeddings");
  if (m.head_dim % 2 != 0) refuse("head_dim", std::to_string(m.head_dim), "RoPE needs an even head_dim");
  if (m.qk_norm && m.attention_bias)
    refuse("attention_bias", "true", "with model.qk_norm = true this is Qwen3, whose attention_bias also biases o_proj");
  if (m.attention_softcap > 0)
    refuse("attention_softcap", fmt::format("{}", m.attention_softcap), "stock Qwen3/Llama/Qwen2 attention has no softcap");
  if (m.logit_softcap > 0)
    refuse("logit_softcap", fmt::format("{}", m.logit_softcap), "stock Qwen3/Llama/Qwen2 LM heads have no softcap");
  // Qwen2/Qwen3 configs can window some layers (use_sliding_window, max_window_layers), but
  // that mapping is not verified against transformers yet, and Llama has none.
  KILN_CHECK(m.sliding_window == 0, where,
             "model.sliding_window = {}: windowed attention is not exported yet (no verified mapping to a stock "
             "Hugging Face class)", m.sliding_window);
  if (m.qk_norm) return HfArch::qwen3;
  return m.attention_bias ? HfArch::qwen2 : HfArch::llama;
}

json hf_config_json(const ModelConfig& m, HfArch arch, const HfSpecialTokens& special, std::string_view dtype) {
  KILN_CHECK(arch == choose_hf_arch(m), "export", "internal: architecture {} does not represent this model",
             hf_model_type(arch));
  json c;
  c["architectures"] = {std::string(hf_architecture(arch))};
  c["model_type"] = std::string(hf_model_type(arch));
  c["vocab_size"] = m.vocab_size;
  c["hidden_size"] = m.hidden;
  c["intermediate_size"] = m.ffn_hidden;
  c["num_hidden_layers"] = m.layers;
  c["num_attention_heads"] = m.heads;
  c["num_key_value_heads"] = m.kv_heads;
  c["head_dim"] = m.head_dim;
  c["hidden_act"] = "silu";
  c["max_position_embeddings"] = m.max_seq_len;
  c["rms_norm_eps"] = m.norm_eps;
  c["initializer_range"] = m.init_std;
  // transformers 4.x reads rope_theta (+ rope_scaling); 5.x reads rope_parameters.
  c["rope_theta"] = m.rope_theta;
  c["rope_scaling"] = nullptr;
  c["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", m.rope_theta}};
  c["attention_dropout"] = 0.0;
  c["tie_word_embeddings"] = m.tie_embeddings;
  c["use_cache"] = true;
  switch (arch) {
    case HfArch::llama:
      c["attention_bias"] = false;
      c["mlp_bias"] = false;
      c["pretraining_tp"] = 1;
      break;
    case HfArch::qwen3:
    case HfArch::qwen2:  // Qwen2 biases q/k/v unconditionally (and never o_proj)
      if (arch == HfArch::qwen3) c["attention_bias"] = false;
      c["use_sliding_window"] = false;
      c["sliding_window"] = nullptr;
      c["max_window_layers"] = m.layers;
      c["layer_types"] = json::array();
      for (int64_t l = 0; l < m.layers; ++l) c["layer_types"].push_back("full_attention");
      break;
  }
  if (special.bos >= 0) c["bos_token_id"] = special.bos;
  if (special.eos >= 0) c["eos_token_id"] = special.eos;
  if (special.pad >= 0) c["pad_token_id"] = special.pad;
  c["torch_dtype"] = std::string(dtype);
  c["dtype"] = std::string(dtype);
  c["kiln_model_name"] = m.name;
  return c;
}

namespace {

// Typed field access with a default, through JsonField: errors name the file and the
// field, a float is not truncated into an integer, and a wrong value is never dump()ed
// (dump() recurses: a value nested 300000 arrays deep overflowed the stack).
template <typename T>
T typed(const JsonField& field) {
  if constexpr (std::is_same_v<T, int64_t>) return field.integer(INT64_MIN, INT64_MAX);
  else if constexpr (std::is_same_v<T, double>) return field.number();
  else if constexpr (std::is_same_v<T, bool>) return field.boolean();
  else return field.string();
}

template <typename T>
T get(const json& c, const char* key, T fallback, const std::string& where) {
  const auto field = JsonField(c, "import", where).find(key);
  return field ? typed<T>(*field) : fallback;
}

template <typename T>
T require(const json& c, const char* key, const std::string& where) {
  KILN_CHECK(c.contains(key) && !c[key].is_null(), "import", "{}: missing field '{}'", where, key);
  return get<T>(c, key, T{}, where);
}

// rope_scaling / rope_parameters must describe plain RoPE; returns theta if given there.
std::optional<double> plain_rope(const json& c, const char* key, const std::string& where) {
  const auto rope = JsonField(c, "import", where).find(key);
  if (!rope) return std::nullopt;
  const std::string type = rope->string_or("rope_type", rope->string_or("type", "default"));
  KILN_CHECK(type == "default", "import", "{}: {}.rope_type = '{}': kiln computes plain RoPE only (no scaling)", where,
             key, printable(type));
  if (const auto factor = rope->find("partial_rotary_factor"))
    KILN_CHECK(factor->number() == 1.0, "import", "{}: {}.partial_rotary_factor != 1: kiln rotates the whole head",
               where, key);
  if (const auto theta = rope->find("rope_theta")) return theta->number();
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
    fail("import", "{}: model_type '{}' is not one kiln imports (qwen3, llama, qwen2)", where, printable(type));
  }
  KILN_CHECK(!c.contains("quantization_config"), "import", "{}: quantized checkpoints are not supported", where);
  const std::string act = get<std::string>(c, "hidden_act", "silu", where);
  KILN_CHECK(act == "silu", "import", "{}: hidden_act = '{}': kiln's MLP is SwiGLU (silu)", where, printable(act));

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
  const JsonField root(c, "import", where);
  if (const auto layer_types = root.find("layer_types"))
    for (size_t i = 0; i < layer_types->array_size(); ++i) {
      const std::string& t = layer_types->element(i).string();
      KILN_CHECK(t == "full_attention", "import", "{}: layer_types has '{}': kiln computes full attention only", where,
                 printable(t));
    }

  spec.special.bos = get<int64_t>(c, "bos_token_id", -1, where);
  spec.special.pad = get<int64_t>(c, "pad_token_id", -1, where);
  const auto eos = root.find("eos_token_id");
  if (eos && eos->is_array() && eos->array_size() > 0) {
    spec.special.eos = typed<int64_t>(eos->element(0));
  } else {
    spec.special.eos = get<int64_t>(c, "eos_token_id", -1, where);
  }
  spec.dtype = get<std::string>(c, "torch_dtype", get<std::string>(c, "dtype", "", where), where);
  return spec;
}

}  // namespace kiln::io

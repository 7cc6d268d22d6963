// config.json's side of io/hf_config.h: the families, and reading a transformers config
// into a ModelConfig (`kiln import hf`). Apart from the writing side, which needs the whole
// model, so the hf_config fuzz target links only the parsers.
#include "io/hf_config.h"

#include "config/config_fields.h"
#include "config/layer_pattern.h"
#include "core/error.h"
#include "core/json_field.h"
#include "core/printable.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string_view>
#include <type_traits>
#include <vector>

namespace kiln::io {

using nlohmann::json;

namespace {

// The stock families: Hugging Face's model_type and class, llama.cpp's architecture.
struct Family {
  HfArch arch;
  std::string_view model_type, architecture, gguf;
};

constexpr Family kFamilies[] = {
    {HfArch::qwen3, "qwen3", "Qwen3ForCausalLM", "qwen3"},
    {HfArch::llama, "llama", "LlamaForCausalLM", "llama"},
    {HfArch::qwen2, "qwen2", "Qwen2ForCausalLM", "qwen2"},
    {HfArch::qwen3_moe, "qwen3_moe", "Qwen3MoeForCausalLM", "qwen3moe"},
    {HfArch::dots1, "dots1", "Dots1ForCausalLM", "dots1"},
    {HfArch::gemma2, "gemma2", "Gemma2ForCausalLM", "gemma2"},
    {HfArch::gemma3, "gemma3_text", "Gemma3ForCausalLM", "gemma3"},
};

const Family& family(HfArch arch) {
  for (const Family& f : kFamilies)
    if (f.arch == arch) return f;
  fail("export", "internal: no family for architecture {}", static_cast<int>(arch));
}

bool has_sparse_layers(const ModelConfig& m) {
  for (int64_t l = 0; l < m.layers; ++l)
    if (layer_choices(m, l).mlp == "moe") return true;
  return false;
}

}  // namespace

std::string_view hf_model_type(HfArch arch) { return family(arch).model_type; }
std::string_view hf_architecture(HfArch arch) { return family(arch).architecture; }
std::string_view gguf_architecture(HfArch arch) { return family(arch).gguf; }

HfArch choose_hf_arch(const ModelConfig& m) {
  if (m.sandwich_norms && !has_sparse_layers(m)) return m.qk_norm ? HfArch::gemma3 : HfArch::gemma2;
  if (has_sparse_layers(m)) return m.moe.router == "sigmoid_bias" ? HfArch::dots1 : HfArch::qwen3_moe;
  if (m.qk_norm) return HfArch::qwen3;
  return m.attention_bias ? HfArch::qwen2 : HfArch::llama;
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

// A required count within the bound of the kiln key it becomes (config/config_fields.cpp),
// checked as it is read: num_hidden_layers = 2^40 sized the per-layer tables below
// (std::bad_alloc) before validate_config could refuse model.layers.
int64_t require_count(const json& c, const char* key, const std::string& where, std::string_view kiln_key) {
  KILN_CHECK(c.contains(key) && !c[key].is_null(), "import", "{}: missing field '{}'", where, key);
  const size_t dot = kiln_key.rfind('.');
  const ConfigField* field = find_config_field(kiln_key.substr(0, dot), kiln_key.substr(dot + 1));
  const int64_t max = field != nullptr && field->rule.max > 0 ? field->rule.max : INT64_MAX;
  return JsonField(c, "import", where)
      .member(key)
      .integer(1, max, fmt::format("{} must be in [1, {}]: {}", kiln_key, max, field ? field->rule.max_why : ""));
}

// The layers `member` holds as a layer set (config/layer_pattern.h): "0,3,5"; "" for none.
std::string layer_list(const std::vector<bool>& member) {
  std::string out;
  for (size_t l = 0; l < member.size(); ++l) {
    if (!member[l]) continue;
    if (!out.empty()) out += ',';
    out += std::to_string(l);
  }
  return out;
}

// Which layers transformers windows, as model.sliding_window and model.full_attention_layers.
// Qwen2/3 (and Dots1): layer_types when given, else the layers from max_window_layers on;
// "sliding_attention" layers see sliding_window keys, which Qwen2/3/Qwen3-MoE drop (full
// attention) unless use_sliding_window. Qwen3-MoE windows every layer when it is set. Llama
// has no window.
void read_windows(const json& c, HfArch arch, const std::string& where, ModelConfig& m) {
  if (arch == HfArch::llama) return;
  const JsonField root(c, "import", where);
  const bool gemma = is_gemma(arch);
  const bool has_flag = arch != HfArch::dots1 && !gemma;  // Dots1Config and Gemma have no use_sliding_window
  const auto window_field = root.find("sliding_window");
  const bool gemma_window = gemma && !(window_field && window_field->is_null());  // absent: Gemma's 4096
  const bool on = gemma ? gemma_window
                        : (!has_flag || get<bool>(c, "use_sliding_window", false, where)) && window_field;
  std::vector<bool> sliding(static_cast<size_t>(m.layers), false);
  if (arch == HfArch::qwen3_moe) {
    sliding.assign(sliding.size(), on);
  } else if (const auto layer_types = root.find("layer_types")) {
    KILN_CHECK(static_cast<int64_t>(layer_types->array_size()) == m.layers, "import",
               "{}: layer_types has {} entries for {} layers", where, layer_types->array_size(), m.layers);
    for (size_t i = 0; i < sliding.size(); ++i) {
      const std::string& t = layer_types->element(i).string();
      KILN_CHECK(t == "full_attention" || t == "sliding_attention", "import",
                 "{}: layer_types[{}] = '{}': kiln computes full_attention and sliding_attention layers", where, i,
                 printable(t));
      sliding[i] = on && t == "sliding_attention";
    }
  } else if (gemma) {
    // Before layer_types: Gemma 2 slides its even layers, Gemma 3 all but every
    // sliding_window_pattern-th (transformers' Gemma2/Gemma3 decoder layers).
    const int64_t pattern = arch == HfArch::gemma2 ? 2 : get<int64_t>(c, "sliding_window_pattern", 6, where);
    KILN_CHECK(pattern >= 1, "import", "{}: sliding_window_pattern = {} must be >= 1", where, pattern);
    for (size_t i = 0; i < sliding.size(); ++i) sliding[i] = on && (static_cast<int64_t>(i) + 1) % pattern != 0;
  } else {
    const int64_t from = get<int64_t>(c, "max_window_layers", arch == HfArch::dots1 ? 62 : 28, where);
    for (size_t i = 0; i < sliding.size(); ++i) sliding[i] = on && static_cast<int64_t>(i) >= from;
  }
  if (std::find(sliding.begin(), sliding.end(), true) == sliding.end()) return;
  const int64_t window = window_field ? window_field->integer(1, INT64_MAX) : 4096;
  m.sliding_window = window;
  std::vector<bool> full(sliding.size());
  for (size_t i = 0; i < sliding.size(); ++i) full[i] = !sliding[i];
  m.full_attention_layers = layer_list(full);  // the global layers
}

// partial_rotary_factor (top level in transformers 4.x, in rope_parameters in 5.x): the
// Llama/Qwen classes kiln imports rotate the whole head whatever it says, so a value below 1
// names a model those classes do not compute as its authors meant; refused rather than guessed.
void check_whole_head_rotary(double factor, const std::string& where, std::string_view key) {
  KILN_CHECK(factor == 1.0, "import",
             "{}: {} = {}: the stock Llama/Qwen classes ignore it and rotate the whole head (kiln's "
             "model.rope.fraction exports only to GGUF's qwen2/qwen3)",
             where, key, factor);
}

// rope_scaling / rope_parameters: plain RoPE or one of kiln's scalings (nn/rope_scaling.h:
// linear, yarn, llama3, with the parameters transformers reads). Returns theta if given
// there; the scaling goes to `rope`.
std::optional<double> read_rope(const json& c, const char* key, const std::string& where, int64_t max_positions,
                                RopeConfig& rope) {
  const auto field = JsonField(c, "import", where).find(key);
  if (!field || field->is_null()) return std::nullopt;
  const std::string type = field->string_or("rope_type", field->string_or("type", "default"));
  if (const auto factor = field->find("partial_rotary_factor"))
    check_whole_head_rotary(factor->number(), where, std::string(key) + ".partial_rotary_factor");
  auto number = [&](const char* name, double fallback) {
    const auto f = field->find(name);
    return f && !f->is_null() ? f->number() : fallback;
  };
  if (type == "linear" || type == "yarn" || type == "llama3") {
    rope.scaling = type;
    rope.factor = field->member("factor").number();
    // yarn without it: transformers 4.x's reading, the model's own context.
    if (type == "llama3" || field->find("original_max_position_embeddings"))
      rope.original_max_seq_len = field->member("original_max_position_embeddings").integer(1, INT32_MAX);
    else if (type == "yarn")
      rope.original_max_seq_len = max_positions;
    if (type == "llama3") {
      rope.low_freq_factor = field->member("low_freq_factor").number();
      rope.high_freq_factor = field->member("high_freq_factor").number();
    }
    if (type == "yarn") {
      rope.beta_fast = number("beta_fast", 32.0);
      rope.beta_slow = number("beta_slow", 1.0);
      rope.attention_factor = number("attention_factor", 0.0);
      KILN_CHECK(number("mscale", 0) == 0 && number("mscale_all_dim", 0) == 0, "import",
                 "{}: {}.mscale / mscale_all_dim: DeepSeek's YaRN attention factor is not kiln's", where, key);
      KILN_CHECK(field->boolean_or("truncate", true), "import",
                 "{}: {}.truncate = false: kiln's YaRN ramp ends on whole pairs (truncate = true)", where, key);
    }
  } else {
    KILN_CHECK(type == "default", "import",
               "{}: {}.rope_type = '{}': kiln computes default, linear, yarn and llama3 RoPE (no dynamic or longrope)",
               where, key, printable(type));
  }
  if (const auto theta = field->find("rope_theta")) return theta->number();
  return std::nullopt;
}

}  // namespace

// Qwen3-MoE's sparse layers: layer l is sparse unless listed in mlp_only_layers, if
// (l + 1) % decoder_sparse_step == 0 (transformers' Qwen3MoeDecoderLayer); the others are
// dense SwiGLU layers of intermediate_size (kiln's alt_mlp_layers).
static void read_qwen3_moe(const json& c, const std::string& where, ModelConfig& m) {
  MoeConfig& moe = m.moe;
  // transformers 5 writes the expert count as num_local_experts (num_experts its alias).
  moe.experts = require<int64_t>(c, c.contains("num_experts") ? "num_experts" : "num_local_experts", where);
  moe.top_k = require<int64_t>(c, "num_experts_per_tok", where);
  moe.expert_hidden = require<int64_t>(c, "moe_intermediate_size", where);
  moe.norm_topk_prob = get<bool>(c, "norm_topk_prob", false, where);
  // transformers' balance loss is top_k x the Switch form kiln computes (it divides the
  // choices by the tokens, kiln by tokens x top_k): the same objective for one sparse
  // layer (tests/test_golden.cpp); over several transformers pools the layers first.
  moe.aux_loss = get<double>(c, "router_aux_loss_coef", 0.001, where) * static_cast<double>(moe.top_k);
  moe.router = "softmax_topk";
  const int64_t step = get<int64_t>(c, "decoder_sparse_step", 1, where);
  KILN_CHECK(step >= 1, "import", "{}: decoder_sparse_step = {} must be >= 1", where, step);
  std::vector<int64_t> dense_only;
  if (const auto only = JsonField(c, "import", where).find("mlp_only_layers"); only && !only->is_null())
    for (size_t i = 0; i < only->array_size(); ++i) dense_only.push_back(only->element(i).integer(0, m.layers - 1));
  std::vector<bool> is_dense(static_cast<size_t>(m.layers));
  for (int64_t l = 0; l < m.layers; ++l) {
    const bool listed = std::find(dense_only.begin(), dense_only.end(), l) != dense_only.end();
    is_dense[static_cast<size_t>(l)] = listed || (l + 1) % step != 0;
  }
  const std::string dense = layer_list(is_dense);
  m.mlp = "moe";
  if (!dense.empty()) m.alt_mlp = "swiglu", m.alt_mlp_layers = dense;
}

// dots.llm1 (Dots1Config): DeepSeek-V3's router (sigmoid_bias), n_shared_experts shared
// experts of moe_intermediate_size each (one shared expert of their summed width), the
// first first_k_dense_replace layers dense SwiGLU layers of intermediate_size.
static void read_dots1(const json& c, const std::string& where, ModelConfig& m) {
  MoeConfig& moe = m.moe;
  moe.router = "sigmoid_bias";
  moe.experts = require<int64_t>(c, "n_routed_experts", where);
  moe.top_k = require<int64_t>(c, "num_experts_per_tok", where);
  moe.expert_hidden = require<int64_t>(c, "moe_intermediate_size", where);
  const int64_t shared = get<int64_t>(c, "n_shared_experts", 0, where);
  KILN_CHECK(shared >= 0, "import", "{}: n_shared_experts = {} must be >= 0", where, shared);
  moe.shared_hidden = shared * moe.expert_hidden;
  moe.norm_topk_prob = get<bool>(c, "norm_topk_prob", false, where);
  moe.routed_scaling = get<double>(c, "routed_scaling_factor", 1.0, where);
  moe.groups = get<int64_t>(c, "n_group", 1, where);
  moe.top_groups = get<int64_t>(c, "topk_group", 1, where);
  moe.aux_loss = 0;  // balanced by the bias, not a loss
  const int64_t dense = get<int64_t>(c, "first_k_dense_replace", 0, where);
  KILN_CHECK(dense >= 0 && dense <= m.layers, "import", "{}: first_k_dense_replace = {} must be in 0..{}", where, dense,
             m.layers);
  m.mlp = "moe";
  if (dense > 0) m.alt_mlp = "swiglu", m.alt_mlp_layers = dense == 1 ? "0" : fmt::format("0-{}", dense - 1);
}

// Gemma 2/3 (Gemma2Config, Gemma3TextConfig): Gemma's norms (gain 1 + w) before and after
// each branch, the embedding x sqrt(hidden), softcaps (Gemma 2's on by default; Gemma 3's
// logit softcap only), Gemma 3's q/k norms. q.k is scaled by query_pre_attn_scalar^-0.5, kiln's by head_dim^-0.5: equal only.
static void read_gemma(const json& c, HfArch arch, const std::string& where, ModelConfig& m) {
  m.norm = "gemma_rmsnorm";
  m.sandwich_norms = true;
  m.embed_scale = std::sqrt(static_cast<double>(m.hidden));
  m.qk_norm = arch == HfArch::gemma3;
  if (m.qk_norm) m.qk_norm_type = "gemma_rmsnorm";
  const JsonField root(c, "import", where);
  auto cap = [&](const char* key, double fallback) {
    const auto f = root.find(key);
    if (!f) return fallback;
    if (f->is_null()) return 0.0;
    const double v = f->number();
    KILN_CHECK(v >= 0, "import", "{}: {} = {} must be >= 0", where, key, v);
    return v;
  };
  const bool two = arch == HfArch::gemma2;
  // transformers' Gemma3Attention stores attn_logit_softcapping and never applies it: Gemma 3
  // attends uncapped whatever its config.json says.
  m.attention_softcap = two ? cap("attn_logit_softcapping", 50.0) : 0.0;
  m.logit_softcap = cap("final_logit_softcapping", two ? 30.0 : 0.0);
  const double scalar = get<double>(c, "query_pre_attn_scalar", 256.0, where);
  KILN_CHECK(scalar == static_cast<double>(m.head_dim), "import",
             "{}: query_pre_attn_scalar = {}: kiln scales q.k by head_dim^-0.5 (head_dim = {})", where, scalar,
             m.head_dim);
}

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
  } else if (type == "qwen3_moe") {
    spec.arch = HfArch::qwen3_moe;
  } else if (type == "dots1") {
    spec.arch = HfArch::dots1;
  } else if (type == "gemma2") {
    spec.arch = HfArch::gemma2;
  } else if (type == "gemma3_text") {
    spec.arch = HfArch::gemma3;
  } else {
    fail("import", "{}: model_type '{}' is not one kiln imports (qwen3, llama, qwen2, qwen3_moe, dots1, gemma2, "
         "gemma3_text)", where, printable(type));
  }
  KILN_CHECK(!c.contains("quantization_config"), "import", "{}: quantized checkpoints are not supported", where);
  const bool gemma = is_gemma(spec.arch);
  // Gemma's MLP reads hidden_activation (its configs carry hidden_act too, unused).
  const char* act_key = gemma && c.contains("hidden_activation") ? "hidden_activation" : "hidden_act";
  const std::string act = get<std::string>(c, act_key, gemma ? "gelu_pytorch_tanh" : "silu", where);
  KILN_CHECK(act == "silu" || act == "gelu_pytorch_tanh", "import",
             "{}: {} = '{}': kiln's gated MLPs are swiglu (silu) and geglu (gelu_pytorch_tanh)", where, act_key,
             printable(act));
  KILN_CHECK(act == "silu" || spec.arch == HfArch::qwen3 || spec.arch == HfArch::llama || spec.arch == HfArch::qwen2 ||
                 gemma,
             "import", "{}: {} = '{}': kiln's experts are SwiGLU (silu)", where, act_key, printable(act));

  ModelConfig& m = spec.model;
  m.vocab_size = require<int64_t>(c, "vocab_size", where);
  m.hidden = require<int64_t>(c, "hidden_size", where);
  m.layers = require_count(c, "num_hidden_layers", where, "model.layers");
  m.heads = require<int64_t>(c, "num_attention_heads", where);
  m.kv_heads = get<int64_t>(c, "num_key_value_heads", m.heads, where);
  m.ffn_hidden = require<int64_t>(c, "intermediate_size", where);
  KILN_CHECK(m.heads > 0 && m.hidden > 0, "import", "{}: hidden_size and num_attention_heads must be positive", where);
  // Qwen3Config's head_dim defaults to 128, Gemma's to 256; Llama/Qwen2/Dots1 fall back to hidden / heads.
  const bool qwen3 = spec.arch == HfArch::qwen3 || spec.arch == HfArch::qwen3_moe;
  m.head_dim = get<int64_t>(c, "head_dim", qwen3 ? 128 : gemma ? 256 : m.hidden / m.heads, where);
  const bool short_context = spec.arch == HfArch::llama || spec.arch == HfArch::dots1;  // their 2048 default
  const int64_t default_context = short_context ? 2048 : spec.arch == HfArch::gemma2 ? 8192
                                                       : spec.arch == HfArch::gemma3 ? 131072 : 32768;
  m.max_seq_len = get<int64_t>(c, "max_position_embeddings", default_context, where);
  m.norm_eps = get<double>(c, "rms_norm_eps", 1e-6, where);
  m.tie_embeddings = get<bool>(c, "tie_word_embeddings", gemma, where);
  m.init_std = get<double>(c, "initializer_range", 0.02, where);
  m.norm = "rmsnorm";
  m.mlp = act == "silu" ? "swiglu" : "geglu";  // the sparse families (silu only) set theirs below
  m.attention = "gqa";
  m.position = "rope";
  m.qk_norm = qwen3 || spec.arch == HfArch::dots1;
  if (spec.arch == HfArch::qwen3_moe) read_qwen3_moe(c, where, m);
  if (spec.arch == HfArch::dots1) read_dots1(c, where, m);
  if (gemma) read_gemma(c, spec.arch, where, m);
  m.attention_bias = spec.arch == HfArch::qwen2;
  m.name = get<std::string>(c, "kiln_model_name", std::string(hf_model_type(spec.arch)) + "-import", where);

  check_whole_head_rotary(get<double>(c, "partial_rotary_factor", 1.0, where), where, "partial_rotary_factor");
  double theta = get<double>(c, "rope_theta", spec.arch == HfArch::gemma3 ? 1e6 : 10000.0, where);
  double local_theta = get<double>(c, "rope_local_base_freq", 10000.0, where);  // Gemma 3's sliding layers
  if (auto t = read_rope(c, "rope_scaling", where, m.max_seq_len, m.rope)) theta = *t;
  const auto per_kind = JsonField(c, "import", where).find("rope_parameters");
  if (spec.arch == HfArch::gemma3 && per_kind && !per_kind->is_null() && per_kind->find("full_attention")) {
    // transformers 5's Gemma 3: one RoPE per layer kind; the sliding one plain.
    const json& kinds = c["rope_parameters"];
    if (auto t = read_rope(kinds, "full_attention", where, m.max_seq_len, m.rope)) theta = *t;
    RopeConfig local_rope;
    if (auto t = read_rope(kinds, "sliding_attention", where, m.max_seq_len, local_rope)) local_theta = *t;
    KILN_CHECK(local_rope.scaling == "none", "import",
               "{}: rope_parameters.sliding_attention.rope_type = '{}': kiln's local RoPE is unscaled", where,
               local_rope.scaling);
  } else if (auto t = read_rope(c, "rope_parameters", where, m.max_seq_len, m.rope)) {
    theta = *t;
  }
  m.rope_theta = theta;

  if (spec.arch != HfArch::qwen2)
    KILN_CHECK(!get<bool>(c, "attention_bias", false, where), "import",
               "{}: attention_bias = true biases o_proj too, which kiln's attention does not compute", where);
  KILN_CHECK(!get<bool>(c, "mlp_bias", false, where), "import", "{}: mlp_bias = true: kiln's MLP has no biases",
             where);
  read_windows(c, spec.arch, where, m);
  // Gemma 3's sliding layers rotate by their own base (kept only where a layer slides).
  if (spec.arch == HfArch::gemma3 && m.sliding_window > 0) m.rope.local_theta = local_theta;
  const JsonField root(c, "import", where);

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

Config hf_import_config(const HfModelSpec& spec, const std::string& where) {
  // The defaults resolved as any config is (paths absolute against the working directory),
  // so the config.toml the import saves loads back the same from its own folder.
  Config config = load_config("");
  config.model = spec.model;
  config.train.micro_batch_tokens = std::max(config.train.micro_batch_tokens, spec.model.max_seq_len);
  try {
    validate_config(config);
  } catch (const Error& e) {
    fail("import", "{}: the model it describes is refused: {}", where, e.what());
  }
  return config;
}

std::map<std::string, std::string> read_weight_map(const json& index, const std::string& where) {
  const JsonField weight_map = JsonField(index, "import", where).member("weight_map");
  std::map<std::string, std::string> shards;
  weight_map.for_each_member([&](const std::string& tensor, const JsonField& file) {
    const std::string& name = file.string();
    // A file of the directory itself: not a path, and not "." (the directory).
    KILN_CHECK(!name.empty() && name != "." && name.find('/') == std::string::npos && name.find("..") == std::string::npos,
               "import", "{}: shard name '{}' is not a file of the model's directory", where, printable(name));
    shards[tensor] = name;
  });
  return shards;
}

}  // namespace kiln::io

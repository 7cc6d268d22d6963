#include "io/hf_names.h"

#include "core/error.h"

#include <array>
#include <string_view>

namespace kiln::io {

namespace {

struct NameRule {
  std::string_view kiln;  // prefix or, for per-layer rules, the part after "layers.N."
  std::string_view hf;
};

// Whole-model tensors.
constexpr std::array<NameRule, 3> kGlobalNames{{
    {"embed.weight", "model.embed_tokens.weight"},
    {"final_norm.weight", "model.norm.weight"},
    {"lm_head.weight", "lm_head.weight"},
}};

// Per-layer tensors: "layers.N." + kiln  <->  "model.layers.N." + hf.
constexpr std::array<NameRule, 14> kLayerNames{{
    {"attn_norm.weight", "input_layernorm.weight"},
    {"mlp_norm.weight", "post_attention_layernorm.weight"},
    {"attn.q_proj.weight", "self_attn.q_proj.weight"},
    {"attn.k_proj.weight", "self_attn.k_proj.weight"},
    {"attn.v_proj.weight", "self_attn.v_proj.weight"},
    {"attn.o_proj.weight", "self_attn.o_proj.weight"},
    {"attn.q_proj.bias", "self_attn.q_proj.bias"},
    {"attn.k_proj.bias", "self_attn.k_proj.bias"},
    {"attn.v_proj.bias", "self_attn.v_proj.bias"},
    {"attn.q_norm.weight", "self_attn.q_norm.weight"},
    {"attn.k_norm.weight", "self_attn.k_norm.weight"},
    {"mlp.gate_proj.weight", "mlp.gate_proj.weight"},
    {"mlp.up_proj.weight", "mlp.up_proj.weight"},
    {"mlp.down_proj.weight", "mlp.down_proj.weight"},
}};

// Splits "<prefix>N.<rest>" into N and rest; false if the name does not have that form.
bool split_layer(std::string_view name, std::string_view prefix, std::string* index, std::string_view* rest) {
  if (name.substr(0, prefix.size()) != prefix) return false;
  name.remove_prefix(prefix.size());
  const size_t dot = name.find('.');
  if (dot == 0 || dot == std::string_view::npos) return false;
  for (char c : name.substr(0, dot))
    if (c < '0' || c > '9') return false;
  *index = std::string(name.substr(0, dot));
  *rest = name.substr(dot + 1);
  return true;
}

}  // namespace

std::string to_hf_name(const std::string& name) {
  for (const NameRule& r : kGlobalNames)
    if (name == r.kiln) return std::string(r.hf);
  std::string index;
  std::string_view rest;
  if (split_layer(name, "layers.", &index, &rest))
    for (const NameRule& r : kLayerNames)
      if (rest == r.kiln) return "model.layers." + index + "." + std::string(r.hf);
  fail("hf", "parameter '{}' has no Hugging Face Qwen3/Llama name", name);
}

std::string from_hf_name(const std::string& name) {
  for (const NameRule& r : kGlobalNames)
    if (name == r.hf) return std::string(r.kiln);
  std::string index;
  std::string_view rest;
  if (split_layer(name, "model.layers.", &index, &rest))
    for (const NameRule& r : kLayerNames)
      if (rest == r.hf) return "layers." + index + "." + std::string(r.kiln);
  fail("hf", "tensor '{}' is not a Qwen3/Llama parameter kiln knows", name);
}

}  // namespace kiln::io

// The configuration half of the component contract's export side (the tensor names are
// nn/parameter.h's ParamName): each component writes the fields of a stock model's
// configuration that describe it -- a Hugging Face config.json, or llama.cpp's GGUF
// metadata -- for the family the exporter chose, or refuses, naming its config key, what
// that family cannot express.
//
// Components of every layer write their fields in turn. A field written twice must get
// the same value: a family with one intermediate_size cannot hold layers of two widths,
// so a per-layer pattern the family has no per-layer field for is refused by the second
// write, naming the key that made the layers differ.
#pragma once

#include <nlohmann/json.hpp>

#include <string>
#include <string_view>

namespace kiln {

class ExportConfig {
 public:
  enum class Format { hf, gguf };

  // family: the stock architecture by its Hugging Face model_type ("qwen3", "llama",
  // "qwen2", "qwen3_moe", "dots1"); GGUF keys are written as "<gguf_arch>.<key>" (llama.cpp's
  // convention: "qwen3moe.expert_count") into `out`.
  ExportConfig(Format format, std::string family, std::string gguf_arch, int64_t layers, nlohmann::json& out);

  Format format() const { return format_; }
  const std::string& family() const { return family_; }
  bool is(std::string_view family) const { return family_ == family; }
  // Gemma 2 or 3 (model_type "gemma2" / "gemma3_text"), in either format.
  bool gemma() const { return is("gemma2") || is("gemma3_text"); }
  int64_t layers() const { return layers_; }

  // out[key] = value; throws naming config_key when key already holds another value.
  void set(const std::string& key, const nlohmann::json& value, std::string_view config_key);
  // out[key][layer] = value in a per-layer list (Hugging Face's layer_types).
  void set_layer(const std::string& key, int64_t layer, const nlohmann::json& value);
  // Appends value to the list out[key] (created empty by the family: mlp_only_layers).
  void append(const std::string& key, const nlohmann::json& value);
  // Throws "[export] <config_key> = <value>: <why>; no stock <family> model computes this".
  [[noreturn]] void refuse(std::string_view config_key, const std::string& value, std::string_view why) const;

 private:
  std::string full_key(const std::string& key) const;

  Format format_;
  std::string family_, gguf_arch_;
  int64_t layers_;
  nlohmann::json& out_;
};

}  // namespace kiln

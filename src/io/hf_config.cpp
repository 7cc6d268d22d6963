#include "io/hf_config.h"

namespace kiln::io {

using nlohmann::json;

json hf_config_json(const Model& model, HfArch arch, const HfSpecialTokens& special, std::string_view dtype) {
  const ModelConfig& m = model.config();
  json c;
  c["architectures"] = {std::string(hf_architecture(arch))};
  c["model_type"] = std::string(hf_model_type(arch));
  if (arch == HfArch::qwen3_moe) {  // every layer sparse unless the dense MLPs list themselves
    c["decoder_sparse_step"] = 1;
    c["mlp_only_layers"] = json::array();
  }
  ExportConfig out(ExportConfig::Format::hf, std::string(hf_model_type(arch)), std::string(gguf_architecture(arch)),
                   m.layers, c);
  model.backbone().export_config(out);
  model.head().export_config(out);
  c["use_cache"] = true;
  if (is_gemma(arch)) {
    // No flag: layer_types says which layers slide (transformers >= 4.53 reads it).
    if (!c.contains("sliding_window")) c["sliding_window"] = nullptr;
    if (arch == HfArch::gemma3) {
      // transformers 5 keeps one RoPE per layer kind; 4.x reads rope_theta, rope_scaling
      // and rope_local_base_freq, written beside it.
      const json global = c["rope_parameters"];
      c["rope_parameters"] = {{"full_attention", global},
                              {"sliding_attention", {{"rope_type", "default"}, {"rope_theta", c["rope_local_base_freq"]}}}};
    }
  } else if (arch != HfArch::llama) {
    // Qwen2/3 and Dots1 window the layers from max_window_layers on when layer_types is
    // absent: none by that rule. They read the windowed layers from layer_types instead
    // (written by the attention); Qwen3-MoE windows all layers by use_sliding_window alone.
    c["max_window_layers"] = m.layers;
    if (!c.contains("use_sliding_window")) {  // no windowed layer
      c["use_sliding_window"] = false;
      c["sliding_window"] = nullptr;
    }
  }
  const bool sparse = arch == HfArch::qwen3_moe || arch == HfArch::dots1;
  if (sparse && !c.contains("intermediate_size")) c["intermediate_size"] = m.ffn_hidden;  // no dense layer wrote it
  if (special.bos >= 0) c["bos_token_id"] = special.bos;
  if (special.eos >= 0) c["eos_token_id"] = special.eos;
  if (special.pad >= 0) c["pad_token_id"] = special.pad;
  c["torch_dtype"] = std::string(dtype);
  c["dtype"] = std::string(dtype);
  c["kiln_model_name"] = m.name;
  return c;
}

}  // namespace kiln::io

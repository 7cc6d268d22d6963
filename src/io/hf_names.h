// kiln's whole-model parameter names <-> Hugging Face Qwen3/Llama names, as a data table.
#pragma once

#include <string>

namespace kiln::io {

// "layers.3.attn.q_proj.weight" -> "model.layers.3.self_attn.q_proj.weight".
// Throws naming the parameter if it has no Hugging Face counterpart.
std::string to_hf_name(const std::string& kiln_name);
// The inverse; throws naming the tensor if it is not a Qwen3/Llama parameter.
std::string from_hf_name(const std::string& hf_name);

}  // namespace kiln::io

// `kiln export hf`: a saved kiln model as a stock Hugging Face model directory that
// transformers' AutoModelForCausalLM / AutoTokenizer load without trust_remote_code:
//   config.json                    Qwen3 / Llama / Qwen2 (io/hf_config.h picks, or refuses)
//   model.safetensors              weights under HF names, format "pt"; above
//                                  max_shard_bytes: model-0000i-of-0000n.safetensors +
//                                  model.safetensors.index.json
//   generation_config.json         bos/eos/pad ids
//   tokenizer.json, tokenizer_config.json, special_tokens_map.json
//                                  a trained tokenizer.json saved with the model is copied;
//                                  otherwise kiln's byte-level tokenizer (byte_tokenizer_json.h)
#pragma once

#include "io/hf_config.h"

#include <cstdint>
#include <string>
#include <vector>

namespace kiln::io {

struct HfExportOptions {
  std::string dtype = "float32";                        // float32 | bfloat16 | float16
  int64_t max_shard_bytes = int64_t(5) << 30;           // transformers' default 5 GB
};

struct HfExportReport {
  HfArch arch = HfArch::qwen3;
  std::vector<std::string> files;  // written, relative to the output directory
  int64_t weight_bytes = 0;
  int64_t tensors = 0;
  int64_t training_only = 0;  // tensors left out: used in training only (multi-token prediction)
};

// model_path: a kiln model (or run) directory. Throws before writing anything when the
// model has no stock class (naming the config key) or the dtype is unknown.
HfExportReport export_hf(const std::string& model_path, const std::string& out_dir, const HfExportOptions& options);

}  // namespace kiln::io

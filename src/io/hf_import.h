// `kiln import hf DIR OUT`: a Hugging Face Qwen3 / Llama / Qwen2 model directory
// (config.json + model.safetensors, or shards with model.safetensors.index.json; bf16,
// fp16 or fp32) into a kiln model directory (model.safetensors in fp32 + config.toml) that
// `kiln sample`, `kiln serve` and training (continued pretraining) read.
//
// Every tensor must map to a kiln parameter with the exact shape, and every parameter must
// be present: a leftover or missing tensor is an error naming it, never a silent drop.
// Tokenizer: kiln's own byte-level tokenizer.json is recognized (the model then uses the
// byte tokenizer); any other tokenizer.json is loaded as a byte-level BPE (ids below the
// config's vocab_size) and then copied next to the model (io/model_dir.h).
#pragma once

#include "io/hf_config.h"

#include <string>
#include <vector>

namespace kiln::io {

struct HfImportReport {
  HfArch arch = HfArch::qwen3;
  ModelConfig model;
  int64_t tensors = 0;
  std::vector<std::string> source_dtypes;  // e.g. {"BF16"}
  bool byte_tokenizer = false;             // tokenizer.json was kiln's byte-level one
  std::vector<std::string> notes;          // things the user should know (printed by the CLI)
};

HfImportReport import_hf(const std::string& hf_dir, const std::string& out_dir);

}  // namespace kiln::io

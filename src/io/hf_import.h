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
#include "model/model.h"

#include <string>
#include <string_view>
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

// Reads the weights of the Hugging Face folder `hf_dir` (model.safetensors or its shards)
// into `model`, built and allocated for the config that folder's config.json describes
// (or one of the same shapes): every parameter by its Hugging Face name, with its exact
// shape; a missing or leftover tensor is an error "[where] ..." naming it (`model_type`
// says what the leftover has no place in). Returns the source dtypes, e.g. {"BF16"}.
// import_hf and train.init_from (train/init_from.h) share it.
// `whole`: with a pipeline stage's model (BuildOptions::layers), the whole model it is part
// of (planned, never allocated): the folder's tensors of the whole model's other parameters
// are the other stages' to read, and only a tensor with no place in the whole model is an
// error.
std::vector<std::string> load_hf_weights(const std::string& hf_dir, Model& model, std::string_view model_type,
                                         std::string_view where, const Model* whole = nullptr);

}  // namespace kiln::io

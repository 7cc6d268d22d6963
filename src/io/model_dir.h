// Where a saved model lives, for the commands that read one (export, serve, sample,
// eval-quant), resolved in one place. Accepted, in this order:
//   a model directory: model.safetensors + config.toml (io::save_model, or one checkpoint
//     step-N/ of train/checkpoint.h, which holds the same two files)
//   a checkpoint root: its `latest` file names the newest complete step-N/
//   a run directory: <run>/model, else <run>/checkpoints/latest
#pragma once

#include "data/tokenizer.h"
#include "io/model_io.h"

#include <array>
#include <memory>
#include <string>

namespace kiln::io {

// The model directory `path` names; throws "[load] 'path' is not a kiln model ..." if none.
std::string resolve_model_dir(const std::string& path);

// Loads the model for inference (no gradients) with buffers for `max_tokens` rows, on
// `device` (its fp32 weights; a GPU Decoder makes its own bf16 copies). A checkpoint's
// manifest checksums are verified first; non-finite or all-zero weights are refused
// (io/weight_check.h).
LoadedModel load_for_inference(const std::string& path, int64_t max_tokens, Device device = Device::cpu);
// The same, checked alike, for a KV-cache decoder (infer/decoder.h), which computes in the
// model's dtype: bf16 mixed precision on the GPU (fp32 masters, bf16 copies), f32 on the CPU.
LoadedModel load_for_decoding(const std::string& path, Device device);

// The tokenizer.json a saved model uses: DIR/tokenizer.json if present (export and import
// put it there), else the file its config's data.tokenizer names; "" for a tokenizer that
// needs no file (kiln's byte-level one). Throws if the named file is gone.
std::string model_tokenizer_json(const std::string& model_dir);
// The tokenizer a saved model was trained with (data.tokenizer, or DIR/tokenizer.json);
// a tokenizer.json with an id at or above the model's vocab_size is an error naming both.
std::unique_ptr<Tokenizer> model_tokenizer(const std::string& model_dir);

// The files of a trained tokenizer that travel with a model (tokenizer.json first; the
// others where present).
inline constexpr std::array<const char*, 3> kTokenizerFiles{"tokenizer.json", "tokenizer_config.json",
                                                            "special_tokens_map.json"};

// Copies those of kTokenizerFiles that folder `from` has into folder `to` (overwriting).
void copy_tokenizer_files(const std::string& from, const std::string& to);

// Puts the tokenizer of data.tokenizer = `setting` (a tokenizer.json, or the folder holding
// one) into `model_dir`, so the model reads it wherever it is moved or run from; for a
// tokenizer without a file (kiln's byte-level one), removes any left there by an earlier
// save. False if the file named is no longer there.
bool save_tokenizer_with_model(const std::string& setting, const std::string& model_dir);

}  // namespace kiln::io

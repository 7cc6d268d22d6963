// train.init_from: continued pretraining. The weights of a trained model become a fresh
// run's starting point; optimizer state, step count, schedule and data position start
// fresh, as in any new run. Accepted, as PATH:
//   a kiln model directory (model.safetensors + config.toml: `kiln import hf`, a run's
//     model/), one checkpoint step-N/, a checkpoint root or a run directory
//     (io/model_dir.h resolves them; a checkpoint's checksums are verified)
//   a Hugging Face folder (config.json + model.safetensors or shards), read through the
//     importer's mapping (io/hf_import.h) without writing a converted copy
// The source is found and its configuration read before any data is read; the tensors are
// read once the run's model is allocated. A resumed run ignores it (the checkpoint wins).
#pragma once

#include "config/config.h"
#include "model/model.h"

#include <optional>
#include <string>
#include <vector>

namespace kiln {

struct InitialWeights {
  std::string dir;           // the kiln model directory or Hugging Face folder PATH names
  bool hugging_face = false;
  std::string model_type;    // Hugging Face only: config.json's model_type ("qwen3", ...)
  Config config;             // the source's configuration (config.toml, or config.json's model)
};

// nullopt when train.init_from is empty. Throws "[train.init_from] PATH: ..." when PATH
// does not exist or holds no model kiln reads.
std::optional<InitialWeights> find_initial_weights(const Config& run);

// The model.* keys (model.name and model.init_std left out) whose values differ between the
// source and the run: "model.hidden (64 -> 32)".
std::vector<std::string> model_differences(const Config& source, const Config& run);

// Reads the source's weights into `model` (built for `run` and allocated). Every parameter
// is checked first, by name and shape, against the model the source's configuration
// builds: "[train.init_from] PATH: tensor 'embed.weight' is [259, 32] there, [259, 48] in
// this run's model (the model differs in: model.hidden (32 -> 48))"; non-finite or all-zero
// weights are refused (io/weight_check.h). Returns the model keys that differ without
// changing a shape (rope_theta, an activation), for the console.
std::vector<std::string> load_initial_weights(const InitialWeights& source, const Config& run, Model& model);

}  // namespace kiln

// A saved model: DIR/model.safetensors (fp32 weights under kiln's whole-model names) and
// DIR/config.toml (the resolved configuration it was trained with).
#pragma once

#include "io/safetensors.h"
#include "model/model.h"
#include "config/config.h"

#include <functional>
#include <memory>
#include <string>

namespace kiln::io {

// Writes weights and config into `dir` (created if missing). `more_weights` adds the weights
// `model` does not hold (a pipeline stage's model: the other stages', train/stage_weights.h).
void save_model(const Model& model, const Config& config, const std::string& dir,
                const std::function<void(SafetensorsWriter&)>& more_weights = {});
// Adds every parameter as fp32 under its whole-model name, with the kiln-model metadata
// (save_model and checkpoints share it, so a checkpoint directory is also a model).
void add_model_weights(SafetensorsWriter& writer, const Model& model);

// Copies weights from a model.safetensors into a built, allocated model; every parameter
// must be present with its exact shape, and no unknown tensor may be left over (but for a
// pipeline stage's model, which reads its part of the whole model's).
void load_weights(Model& model, const std::string& safetensors_path);
void load_weights(Model& model, const SafetensorsFile& file);

struct LoadedModel {
  Config config;
  std::unique_ptr<Model> model;
};

// Reads DIR/config.toml, builds the model for `options` (training off by default for
// sampling), allocates it and loads DIR/model.safetensors.
LoadedModel load_model(const std::string& dir, BuildOptions options);

}  // namespace kiln::io

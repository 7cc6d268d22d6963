// Per-layer patterns: which layers a model.*_layers key picks, and what each layer of a
// model then gets (its token mixer, attention window, position encoding and MLP).
//
// A layer set is written as comma-separated items, each adding layers (0-based):
//   3          layer 3                      2-5        layers 2, 3, 4 and 5
//   every:4    layers 3, 7, 11, ... (each 4th: l % 4 == 3, as Gemma 3's global layers)
//   first:2    layers 0 and 1               from:2     layers 2 and up
//   all        every layer                  ""         none
// and a leading "~" takes the complement of the whole set ("~every:2": layers 0, 2, 4 ...).
#pragma once

#include "config/config.h"

#include <string>
#include <string_view>
#include <vector>

namespace kiln {

// member[l] is true for the layers `text` names; throws naming `key` (e.g.
// "model.nope_layers") when the text is malformed or names a layer >= layers.
std::vector<bool> parse_layer_set(std::string_view key, std::string_view text, int64_t layers);

// What layer `layer` of `model` gets once the patterns are applied.
struct LayerChoices {
  std::string mixer;      // the token mixer's registry name (model.attention or model.alt_attention)
  int64_t window = 0;     // attention window (0: full causal)
  bool rotary = true;     // model.position applies (false: a NoPE layer)
  std::string mlp;        // the MLP's registry name
};

LayerChoices layer_choices(const ModelConfig& model, int64_t layer);

// Throws naming the key when a pattern key of `model` is malformed or inconsistent.
void validate_layer_patterns(const ModelConfig& model);

}  // namespace kiln

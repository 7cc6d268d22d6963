// The registries of model components and the specs their factories take.
// `kiln list` prints them; a new variant registers itself in its own file's
// register_* function, called from modules.cpp.
#pragma once

#include "config/config.h"
#include "config/layer_pattern.h"
#include "nn/interfaces.h"
#include "nn/parameter.h"
#include "nn/registry.h"

namespace kiln {

struct NormSpec {
  NameScope names;    // its parameters' prefixes, e.g. "layers.0.attn_norm." / "model.layers.0.input_layernorm."
  int64_t dim = 0;    // normalized (last) dimension
  int64_t rows = 0;   // most rows one forward sees
  double eps = 1e-6;
  double alpha_init = 0.5;  // DyT norms: alpha's initial value (model.dyt_alpha)
};

struct LayerSpec {
  NameScope names;         // the layer's prefixes: "layers.3." / "model.layers.3." / "blk.3."
  int64_t index = 0;
  const ModelConfig* model = nullptr;
  LayerChoices choices;    // what this layer gets of the model's per-layer patterns
};

// The config key that chose the layer's token mixer, for its errors and export refusals.
inline const char* mixer_key(const LayerSpec& layer) {
  return layer.choices.mixer == layer.model->attention ? "model.attention" : "model.alt_attention";
}

using NormRegistry = Registry<Norm, BuildContext&, const NormSpec&>;
using PositionRegistry = Registry<PositionEncoding, BuildContext&, const ModelConfig&>;
using MixerRegistry = Registry<TokenMixer, BuildContext&, const LayerSpec&, PositionEncoding&>;
using MlpRegistry = Registry<Mlp, BuildContext&, const LayerSpec&>;

NormRegistry& norm_registry();
PositionRegistry& position_registry();
MixerRegistry& mixer_registry();  // token mixers: model.attention, model.alt_attention
MlpRegistry& mlp_registry();

// Registration hooks of the built-in components (one per file).
void register_rms_norm(NormRegistry& registry);
void register_layer_norm(NormRegistry& registry);
void register_gemma_rms_norm(NormRegistry& registry);
void register_dyt_norm(NormRegistry& registry);
void register_rope(PositionRegistry& registry);
void register_gqa_attention(MixerRegistry& registry);
void register_kda_mixer(MixerRegistry& registry);
void register_mla_mixer(MixerRegistry& registry);
void register_swiglu_mlp(MlpRegistry& registry);
void register_geglu_mlp(MlpRegistry& registry);
void register_ungated_mlps(MlpRegistry& registry);

}  // namespace kiln

// muP, the maximal update parametrization (Yang et al. 2022, Tensor Programs V; seed 004;
// docs/mup.md): with model.mup_base_width = B > 0, a model of width W = model.hidden is
// initialized and trained so that hyperparameters tuned at width B transfer to W unchanged.
// The width ratio W / B stands for every fan-in that grows with the model (ffn_hidden and
// heads x head_dim are taken to scale with hidden, as in the presets' families).
//   - matrices reading the width: init std x 1 / sqrt(W / B) (variance ~ 1 / fan-in);
//   - residual writers (attention o, MLP down): that, x 1 / sqrt(2 L) as without muP;
//   - embedding, gains and biases: unscaled (their fan-in does not grow);
//   - the LM head: zero-initialized (untied only: the embedding cannot start at zero);
//   - AdamW learning rates of matrices reading the width: x B / W
//     (train/optimizer_groups.cpp); Muon's: unscaled (seed 004).
#pragma once

#include "nn/param_role.h"

namespace kiln {

struct ModelConfig;

bool mup_enabled(const ModelConfig& m);
// W / B, or 1 when muP is off.
double mup_width_ratio(const ModelConfig& m);
// The init std of a matrix whose fan-in is the width (q/k/v, MLP gate/up, router).
double hidden_init_std(const ModelConfig& m);
// The init std of a residual writer: hidden_init_std / sqrt(2 x model.layers), so the
// residual stream's variance does not grow with depth (GPT-2's scaling, kept without muP).
double residual_init_std(const ModelConfig& m);
// Whether a role's parameters are matrices whose fan-in is the width, so that AdamW's
// per-coordinate update moves their outputs ~ W times as far: the ones muP's learning
// rate scales. Embeddings (fan-in: one-hot), gains and biases are not.
bool mup_scales_role(ParamRole role);
// Refuses muP with a tied head, naming both keys (the head must start at zero).
void check_mup(const ModelConfig& m);

}  // namespace kiln

// RoPE frequency scalings (model.rope.scaling): the inverse frequencies of rope_theta
// stretched for a longer context, and the factor YaRN multiplies cos and sin by. Each is
// computed as transformers' modeling_rope_utils does, in the same order and precision
// (fp32 tensors, double scalars), so an exported model's logits match within fp32 rounding.
//
//   none    1 / theta^(2j / D)
//   linear  none / factor (positions interpolated: Chen et al. 2023, kaiokendev)
//   ntk     none with theta x factor^(D / (D - 2)) (static "NTK-aware"; bloc97)
//   yarn    per pair, a ramp from extrapolation (fast rotations: none) to interpolation
//           (slow: linear) between beta_fast and beta_slow rotations over the original
//           context; cos/sin x attention_factor (Peng et al. 2023)
//   llama3  wavelengths below original / high_freq_factor kept, above original /
//           low_freq_factor divided by factor, a smooth blend between (Llama 3.1)
#pragma once

#include "config/config.h"

#include <vector>

namespace kiln {

struct RopeFrequencies {
  std::vector<float> inv_freq;   // [head_dim / 2]
  float attention_factor = 1.0f; // multiplies cos and sin (q.k by its square)
};

RopeFrequencies rope_frequencies(const RopeConfig& rope, double theta, int64_t head_dim);

// ntk's effective base: the theta a plain RoPE needs for the same frequencies (how it
// exports: transformers' "dynamic" type would change them with the sequence length).
double ntk_theta(const RopeConfig& rope, double theta, int64_t head_dim);

}  // namespace kiln

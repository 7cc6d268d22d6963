#include "nn/rope_scaling.h"

#include "core/error.h"
#include "ops/rope/rope.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace kiln {

namespace {

// YaRN's pair index where a frequency completes `rotations` turns over `context` positions
// (the "inverse dimension formula"), in double as transformers' math.log does.
double correction_dim(double rotations, int64_t dim, double theta, double context) {
  return (static_cast<double>(dim) * std::log(context / (rotations * 2 * std::numbers::pi))) / (2 * std::log(theta));
}

std::vector<float> yarn_inverse_frequencies(const RopeConfig& r, double theta, int64_t dim) {
  const double context = static_cast<double>(r.original_max_seq_len);
  // truncate = true (transformers' default): the ramp's ends on whole pairs.
  const double low = std::max(std::floor(correction_dim(r.beta_fast, dim, theta, context)), 0.0);
  double high = std::min(std::ceil(correction_dim(r.beta_slow, dim, theta, context)), static_cast<double>(dim - 1));
  if (low == high) high += 0.001;  // as transformers: no zero-width ramp
  const float factor = static_cast<float>(r.factor);
  std::vector<float> inv(static_cast<size_t>(dim / 2));
  for (int64_t j = 0; j < dim / 2; ++j) {
    const float pos_freq = std::pow(static_cast<float>(theta), static_cast<float>(2 * j) / static_cast<float>(dim));
    const float extrapolation = 1.0f / pos_freq, interpolation = 1.0f / (factor * pos_freq);
    const float ramp =
        std::clamp((static_cast<float>(j) - static_cast<float>(low)) / static_cast<float>(high - low), 0.0f, 1.0f);
    const float keep = 1.0f - ramp;  // the share of extrapolation
    inv[static_cast<size_t>(j)] = interpolation * (1.0f - keep) + extrapolation * keep;
  }
  return inv;
}

std::vector<float> llama3_inverse_frequencies(const RopeConfig& r, double theta, int64_t dim) {
  std::vector<float> inv = ops::rope_inverse_frequencies(theta, dim);
  const double context = static_cast<double>(r.original_max_seq_len);
  // torch compares and divides an fp32 tensor by python numbers in fp32.
  const float low_freq_wavelen = static_cast<float>(context / r.low_freq_factor);
  const float high_freq_wavelen = static_cast<float>(context / r.high_freq_factor);
  const float factor = static_cast<float>(r.factor);
  // torch evaluates number / tensor as reciprocal(tensor) * number: so here.
  auto divide_number = [](double number, float x) { return (1.0f / x) * static_cast<float>(number); };
  for (float& f : inv) {
    const float wavelen = divide_number(2 * std::numbers::pi, f);
    const float scaled = wavelen > low_freq_wavelen ? f / factor : f;
    if (wavelen < high_freq_wavelen || wavelen > low_freq_wavelen) {
      f = scaled;
      continue;
    }
    const float smooth = (divide_number(context, wavelen) - static_cast<float>(r.low_freq_factor)) /
                         static_cast<float>(r.high_freq_factor - r.low_freq_factor);
    f = (1.0f - smooth) * scaled / factor + smooth * scaled;
  }
  return inv;
}

}  // namespace

double ntk_theta(const RopeConfig& rope, double theta, int64_t head_dim) {
  const double d = static_cast<double>(head_dim);
  return theta * std::pow(rope.factor, d / (d - 2));
}

RopeFrequencies rope_frequencies(const RopeConfig& r, double theta, int64_t head_dim) {
  RopeFrequencies out;
  if (r.scaling == "none") {
    out.inv_freq = ops::rope_inverse_frequencies(theta, head_dim);
  } else if (r.scaling == "linear") {
    out.inv_freq = ops::rope_inverse_frequencies(theta, head_dim);
    for (float& f : out.inv_freq) f /= static_cast<float>(r.factor);
  } else if (r.scaling == "ntk") {
    out.inv_freq = ops::rope_inverse_frequencies(ntk_theta(r, theta, head_dim), head_dim);
  } else if (r.scaling == "yarn") {
    out.inv_freq = yarn_inverse_frequencies(r, theta, head_dim);
    out.attention_factor = static_cast<float>(r.attention_factor > 0 ? r.attention_factor
                                              : r.factor <= 1   ? 1.0
                                                                : 0.1 * std::log(r.factor) + 1.0);
  } else if (r.scaling == "llama3") {
    out.inv_freq = llama3_inverse_frequencies(r, theta, head_dim);
  } else {
    fail("rope", "model.rope.scaling = '{}': expected none, linear, ntk, yarn or llama3", r.scaling);
  }
  return out;
}

}  // namespace kiln

// The reference the decoder and the evaluator are held to: the training path's forward of
// one whole sequence (positions 0.., no targets), its logits read back, and the largest
// difference of two logit rows scaled by the reference's largest magnitude.
#pragma once

#include "data/batch.h"
#include "model/model.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

namespace kiln::test {

// Logits [rows, vocab] of positions first_row.. of `tokens`, by the full forward.
inline std::vector<float> full_forward_logits(Model& model, const std::vector<int32_t>& tokens, int64_t first_row,
                                              int64_t rows) {
  HostBatch b;
  b.tokens = tokens;
  b.targets.assign(tokens.size(), kIgnoreTarget);
  b.positions.resize(tokens.size());
  std::iota(b.positions.begin(), b.positions.end(), 0);
  b.cu_seqlens = {0, static_cast<int32_t>(tokens.size())};
  b.max_seqlen = static_cast<int32_t>(tokens.size());
  model.load_batch(b);
  std::vector<float> out;
  model.logits(first_row, rows, out);
  return out;
}

// Logits of the last position of `tokens`.
inline std::vector<float> full_forward_last(Model& model, const std::vector<int32_t>& tokens) {
  return full_forward_logits(model, tokens, static_cast<int64_t>(tokens.size()) - 1, 1);
}

// max |a - b| / max |b| over n values; every a must be finite.
inline double scaled_diff(const float* a, const float* b, int64_t n) {
  double diff = 0, scale = 0;
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_TRUE(std::isfinite(a[i]));
    diff = std::max(diff, std::fabs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::fabs(static_cast<double>(b[i])));
  }
  return diff / scale;
}

}  // namespace kiln::test

// The reference the decoder and the evaluator are held to: the training path's forward of
// one whole sequence (positions 0.., no targets), its logits read back, and the largest
// difference of two logit rows scaled by the reference's largest magnitude.
#pragma once

#include "core/rng.h"
#include "data/batch.h"
#include "model/model.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

namespace kiln::test {

// n tokens drawn uniformly from the byte-level vocabulary (259 ids), from `seed`.
inline std::vector<int32_t> random_tokens(int64_t n, uint64_t seed) {
  Rng rng(seed);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = static_cast<int32_t>(rng.below(259));
  return t;
}

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

// One row of a decode step: its sequence, its decoder slot and its position (the token
// the decoder is given is the sequence's token there).
struct DecodeRow {
  const std::vector<int32_t>* sequence;
  int32_t slot, position;
};

// Runs `rows` as one decode step of `decoder` (over `model`'s weights); the worst scaled
// difference (scaled_diff) of their logits from the full forward over each row's prefix.
template <class DecoderT>
double decode_step_error(Model& model, DecoderT& decoder, const std::vector<DecodeRow>& rows) {
  std::vector<int32_t> tok, slot, pos, which;
  for (const DecodeRow& r : rows) {
    tok.push_back((*r.sequence)[static_cast<size_t>(r.position)]), slot.push_back(r.slot), pos.push_back(r.position);
    which.push_back(static_cast<int32_t>(which.size()));
  }
  decoder.forward(tok, slot, pos);
  std::vector<float> logits;
  decoder.logits(which, logits);
  double worst = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    const DecodeRow& r = rows[i];
    const std::vector<int32_t> prefix(r.sequence->begin(), r.sequence->begin() + r.position + 1);
    const std::vector<float> want = full_forward_last(model, prefix);
    worst = std::max(worst, scaled_diff(logits.data() + i * want.size(), want.data(), static_cast<int64_t>(want.size())));
  }
  return worst;
}

// Every sequence one token a step, in lockstep from position 0 (one slot each, a shorter
// sequence dropping out when it ends); the worst decode_step_error of the steps.
template <class DecoderT>
double lockstep_decode_error(Model& model, DecoderT& decoder, const std::vector<std::vector<int32_t>>& sequences) {
  size_t longest = 0;
  for (const auto& s : sequences) longest = std::max(longest, s.size());
  double worst = 0;
  for (size_t position = 0; position < longest; ++position) {
    std::vector<DecodeRow> rows;
    for (size_t s = 0; s < sequences.size(); ++s)
      if (position < sequences[s].size())
        rows.push_back({&sequences[s], static_cast<int32_t>(s), static_cast<int32_t>(position)});
    worst = std::max(worst, decode_step_error(model, decoder, rows));
  }
  return worst;
}

}  // namespace kiln::test

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
#include <functional>
#include <numeric>
#include <vector>

namespace kiln::test {

// n tokens drawn uniformly from a vocabulary (default: the byte-level one, 259 ids), from `seed`.
inline std::vector<int32_t> random_tokens(int64_t n, uint64_t seed, int64_t vocab = 259) {
  Rng rng(seed);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = static_cast<int32_t>(rng.below(static_cast<uint64_t>(vocab)));
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

// The decode script of the mixers' decoder tests (MLA, KDA, Block Attention Residuals; CPU
// and GPU), over two slots: slot 0 prefills a sequence in chunks of 4, 1, 3, 1 and 5 rows
// while slot 1 decodes another a token per step; slot 1 is reset and takes a new sequence;
// slot 0 prefills a 5-token prompt, slot 1 forks it (copy_slot) and both go on with
// different tokens. `step` runs one step's rows; `reset` and `copy` make the slot calls.
struct SlotScript {
  std::function<void(const std::vector<DecodeRow>&)> step;
  std::function<void(int32_t slot)> reset;
  std::function<void(int32_t from, int32_t to, int64_t positions)> copy;
};
inline constexpr int kSlotScriptSteps = 18, kSlotScriptRows = 45;

// Runs the script on tokens of a `vocab`-id vocabulary; returns the rows it ran
// (kSlotScriptRows).
inline int run_slot_script(const SlotScript& s, int64_t vocab = 259) {
  const std::vector<int32_t> a = random_tokens(14, 1, vocab), b = random_tokens(9, 2, vocab),
                             fresh = random_tokens(7, 3, vocab), shared = random_tokens(12, 4, vocab);
  std::vector<int32_t> other = shared;  // shared's 5-token prompt, then other tokens
  for (size_t i = 5; i < other.size(); ++i) other[i] = static_cast<int32_t>((other[i] + 7) % vocab);
  int rows_run = 0;
  auto step = [&](const std::vector<DecodeRow>& rows) { s.step(rows), rows_run += static_cast<int>(rows.size()); };
  s.reset(0), s.reset(1);
  int32_t at = 0;
  const std::vector<int> chunks = {4, 1, 3, 1, 5};
  for (size_t c = 0; c < chunks.size(); ++c) {
    std::vector<DecodeRow> rows;
    for (int i = 0; i < chunks[c]; ++i) rows.push_back({&a, 0, at++});
    rows.push_back({&b, 1, static_cast<int32_t>(c)});
    step(rows);
  }
  s.reset(1);  // slot 1 reused: its own tokens only from here
  step({{&fresh, 1, 0}, {&fresh, 1, 1}, {&fresh, 1, 2}});
  for (int32_t p = 3; p < 7; ++p) step({{&fresh, 1, p}});
  s.reset(0);
  step({{&shared, 0, 0}, {&shared, 0, 1}, {&shared, 0, 2}, {&shared, 0, 3}, {&shared, 0, 4}});
  s.reset(1);
  s.copy(0, 1, 5);
  for (int32_t p = 5; p < 12; ++p) step({{&shared, 0, p}, {&other, 1, p}});
  return rows_run;
}

// The script on one decoder, each step's logits against the full forward of `model`: the
// worst decode_step_error. Checks that every row ran.
template <class DecoderT>
double slot_script_decode_error(Model& model, DecoderT& decoder) {
  double worst = 0;
  const int rows = run_slot_script({[&](const std::vector<DecodeRow>& r) {
                                      worst = std::max(worst, decode_step_error(model, decoder, r));
                                    },
                                    [&](int32_t slot) { decoder.reset_slot(slot); },
                                    [&](int32_t from, int32_t to, int64_t n) { decoder.copy_slot(from, to, n); }},
                                   model.config().vocab_size);
  EXPECT_EQ(rows, kSlotScriptRows);
  return worst;
}

}  // namespace kiln::test

// Shared by the CPU and GPU decoder tests: greedy generation through the Decoder, one
// step at a time or in greedy_chain() chains.
#pragma once

#include "infer/decoder.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <vector>

namespace kiln::test {

// Prefills `prompts` (sequence i in slot i, one forward), then generates `steps` greedy
// tokens per sequence, `chain` steps per Decoder::greedy_chain call (1: forward + greedy
// per step). The tokens, step-major.
inline std::vector<int32_t> greedy_tokens(Decoder& d, const std::vector<std::vector<int32_t>>& prompts, int64_t steps,
                                   int64_t chain) {
  const auto n = static_cast<int32_t>(prompts.size());
  std::vector<int32_t> tok, slot, pos, rows, last, ids, out;
  for (int32_t s = 0; s < n; ++s) {
    for (size_t i = 0; i < prompts[static_cast<size_t>(s)].size(); ++i)
      tok.push_back(prompts[static_cast<size_t>(s)][i]), slot.push_back(s), pos.push_back(static_cast<int32_t>(i));
    rows.push_back(static_cast<int32_t>(tok.size() - 1));
  }
  d.forward(tok, slot, pos);
  d.greedy(rows, last);
  slot.resize(static_cast<size_t>(n)), pos.resize(static_cast<size_t>(n));
  std::iota(slot.begin(), slot.end(), 0);
  std::iota(rows.begin(), rows.end(), 0);
  for (int64_t step = 0; step < steps;) {
    for (int32_t s = 0; s < n; ++s)
      pos[static_cast<size_t>(s)] = static_cast<int32_t>(prompts[static_cast<size_t>(s)].size() + step);
    d.forward(last, slot, pos);
    const int64_t k = std::min(chain, steps - step);
    if (chain == 1) {
      d.greedy(rows, ids);
    } else {
      d.greedy_chain(k, ids);
    }
    EXPECT_EQ(ids.size(), static_cast<size_t>(k * n));
    out.insert(out.end(), ids.begin(), ids.end());
    last.assign(ids.end() - n, ids.end());
    step += k;
  }
  return out;
}

}  // namespace kiln::test

// Expert choices for the MoE op cases (cases_moe.cpp): each token's k distinct experts
// under a load pattern, and their dispatch computed here by the definition (rows grouped by
// expert, within an expert in pair order), independently of ops/moe.
#pragma once

#include "core/rng.h"

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

namespace kiln::op_test {

// random: any k experts; few: only the first max(k, E / 3) experts get tokens (the others
// none); all_to_last: expert E - 1 is in every token's choices (it takes every token).
enum class Load { random, few, all_to_last };

inline std::string load_name(Load l) { return l == Load::random ? "random" : l == Load::few ? "few" : "all_to_last"; }

struct MoeRoutes {
  int64_t tokens = 0, experts = 0, top_k = 0;
  std::vector<int32_t> ids;          // [T k]: pair p = t k + j, token t's j-th choice
  std::vector<int32_t> counts;       // [E]
  std::vector<int32_t> offsets;      // [E + 1]
  std::vector<int32_t> pair_of_row;  // [T k]
  std::vector<int32_t> row_of_pair;  // [T k]
};

inline MoeRoutes moe_routes(int64_t tokens, int64_t experts, int64_t top_k, Load load, uint64_t seed) {
  MoeRoutes r{tokens, experts, top_k, {}, {}, {}, {}, {}};
  Rng rng(seed);
  const int64_t pool = load == Load::few ? std::max(top_k, experts / 3) : experts;
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<int32_t> candidates(static_cast<size_t>(pool));
    std::iota(candidates.begin(), candidates.end(), 0);
    for (int64_t j = 0; j < top_k; ++j) {  // a partial Fisher-Yates shuffle
      const int64_t pick = j + static_cast<int64_t>(rng.below(static_cast<uint64_t>(pool - j)));
      std::swap(candidates[static_cast<size_t>(j)], candidates[static_cast<size_t>(pick)]);
    }
    std::vector<int32_t> mine(candidates.begin(), candidates.begin() + top_k);
    const auto last = static_cast<int32_t>(experts - 1);
    if (load == Load::all_to_last && std::find(mine.begin(), mine.end(), last) == mine.end())
      mine[static_cast<size_t>(t % top_k)] = last;
    r.ids.insert(r.ids.end(), mine.begin(), mine.end());
  }
  r.counts.assign(static_cast<size_t>(experts), 0);
  for (int32_t e : r.ids) ++r.counts[static_cast<size_t>(e)];
  r.offsets.assign(static_cast<size_t>(experts + 1), 0);
  for (int64_t e = 0; e < experts; ++e)
    r.offsets[static_cast<size_t>(e + 1)] = r.offsets[static_cast<size_t>(e)] + r.counts[static_cast<size_t>(e)];
  r.pair_of_row.resize(r.ids.size());
  r.row_of_pair.resize(r.ids.size());
  int32_t row = 0;
  for (int64_t e = 0; e < experts; ++e)
    for (size_t p = 0; p < r.ids.size(); ++p)
      if (r.ids[p] == e) r.pair_of_row[static_cast<size_t>(row)] = static_cast<int32_t>(p), r.row_of_pair[p] = row++;
  return r;
}

}  // namespace kiln::op_test

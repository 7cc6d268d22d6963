// A double as a JSON value for the files kiln writes (metrics.jsonl, summary.json, eval
// results): JSON has no NaN or Inf, so a non-finite value is written as null, which every
// reader (kiln plot, pandas, jq) takes as missing rather than failing on the line.
#pragma once

#include <nlohmann/json.hpp>

#include <cmath>

namespace kiln {

inline nlohmann::json json_number(double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(nullptr); }

}  // namespace kiln

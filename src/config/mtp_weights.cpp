#include "config/mtp_weights.h"

#include "core/error.h"

#include <charconv>
#include <cmath>
#include <string_view>

namespace kiln {

namespace {

// One comma-separated entry as a finite, non-negative number.
double parse_weight(std::string_view text, const std::string& all) {
  while (!text.empty() && text.front() == ' ') text.remove_prefix(1);
  while (!text.empty() && text.back() == ' ') text.remove_suffix(1);
  double value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  KILN_CHECK(ec == std::errc() && end == text.data() + text.size() && std::isfinite(value) && value >= 0, "config",
             "model.mtp.weights = '{}': '{}' is not a non-negative number", all, text);
  return value;
}

}  // namespace

MtpLossWeights mtp_loss_weights(const ModelConfig& model) {
  const MtpConfig& mtp = model.mtp;
  MtpLossWeights out;
  if (mtp.depth == 0) {
    KILN_CHECK(mtp.weights.empty(), "config", "model.mtp.weights = '{}' needs model.mtp.depth > 0", mtp.weights);
    return out;
  }
  const auto depth = static_cast<size_t>(mtp.depth);
  if (mtp.weights.empty()) {
    // DeepSeek-V3 weights the depths' mean by lambda = 0.1 (seed 001 too); seed 002
    // averages its extra head's loss with the main one.
    const bool parallel = mtp.form == "parallel";
    const double each = parallel ? 1.0 / static_cast<double>(mtp.depth + 1) : 0.1 / static_cast<double>(mtp.depth);
    out.main = parallel ? each : 1.0;
    out.depths.assign(depth, each);
    return out;
  }
  std::string_view rest = mtp.weights;
  while (true) {
    const size_t comma = rest.find(',');
    out.depths.push_back(parse_weight(rest.substr(0, comma), mtp.weights));
    if (comma == std::string_view::npos) break;
    rest.remove_prefix(comma + 1);
  }
  KILN_CHECK(out.depths.size() == depth, "config", "model.mtp.weights = '{}' gives {} weights for model.mtp.depth = {}",
             mtp.weights, out.depths.size(), mtp.depth);
  return out;
}

}  // namespace kiln

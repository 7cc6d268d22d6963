#include "train/metrics.h"

#include "core/error.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cmath>

namespace kiln {

MetricsLog::MetricsLog(const std::string& path) : path_(path), out_(path, std::ios::app) {
  KILN_CHECK(out_.good(), "train", "cannot write the metrics file '{}'", path);
}

void MetricsLog::step(const StepMetrics& m) {
  nlohmann::json j = {{"kind", "train"},         {"step", m.step},          {"loss", m.loss},
                      {"lr", m.lr},              {"grad_norm", m.grad_norm}, {"tokens", m.tokens},
                      {"target_tokens", m.target_tokens}, {"step_seconds", m.step_seconds},
                      {"elapsed_seconds", m.elapsed_seconds}};
  if (m.z > 0) j["z"] = m.z;
  out_ << j.dump() << '\n';
  out_.flush();
}

void MetricsLog::validation(int64_t step, double loss, double elapsed_seconds) {
  out_ << nlohmann::json{{"kind", "validation"}, {"step", step}, {"loss", loss}, {"elapsed_seconds", elapsed_seconds}}.dump()
       << '\n';
  out_.flush();
}

void MetricsLog::sample(int64_t step, const std::string& text) {
  // Samples may hold invalid UTF-8 (a byte model can cut a character): replace, not throw.
  out_ << nlohmann::json{{"kind", "sample"}, {"step", step}, {"text", text}}.dump(
              -1, ' ', false, nlohmann::json::error_handler_t::replace)
       << '\n';
  out_.flush();
}

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const int64_t s = static_cast<int64_t>(seconds + 0.5);
  if (s < 60) return fmt::format("{}s", s);
  if (s < 3600) return fmt::format("{}m{:02}s", s / 60, s % 60);
  return fmt::format("{}h{:02}m", s / 3600, (s % 3600) / 60);
}

}  // namespace kiln

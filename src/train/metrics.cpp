#include "train/metrics.h"

#include "core/error.h"
#include "io/durable_io.h"

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
  for (const auto& [name, value] : m.terms) j[name] = value;
  if (!m.skipped.empty()) j["skipped"] = m.skipped;
  if (m.skipped_total > 0) j["skipped_total"] = m.skipped_total;
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

void MetricsLog::skip(int64_t step, const std::string& reason, double loss, double grad_norm) {
  // JSON has no NaN or Inf: non-finite values are written as null.
  auto number = [](double x) { return std::isfinite(x) ? nlohmann::json(x) : nlohmann::json(nullptr); };
  out_ << nlohmann::json{{"kind", "skip"}, {"step", step}, {"reason", reason}, {"loss", number(loss)},
                         {"grad_norm", number(grad_norm)}}.dump()
       << '\n';
  out_.flush();
}

void MetricsLog::checkpoint(int64_t step, const std::string& path, double seconds) {
  out_ << nlohmann::json{{"kind", "checkpoint"}, {"step", step}, {"path", path}, {"seconds", seconds}}.dump() << '\n';
  out_.flush();
}

void MetricsLog::resume(int64_t step, const std::string& path) {
  out_ << nlohmann::json{{"kind", "resume"}, {"step", step}, {"path", path}}.dump() << '\n';
  out_.flush();
}

void truncate_metrics_after(const std::string& path, int64_t step) {
  std::ifstream in(path);
  if (!in) return;
  std::string kept, line;
  while (std::getline(in, line)) {
    if (in.eof()) break;  // no newline: a line torn by the crash
    const auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.is_object()) continue;
    if (j.contains("step") && j["step"].is_number_integer() && j["step"].get<int64_t>() > step) continue;
    kept += line;
    kept += '\n';
  }
  in.close();
  io::replace_file_atomically(path, kept, "train");
}

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const int64_t s = static_cast<int64_t>(seconds + 0.5);
  if (s < 60) return fmt::format("{}s", s);
  if (s < 3600) return fmt::format("{}m{:02}s", s / 60, s % 60);
  return fmt::format("{}h{:02}m", s / 3600, (s % 3600) / 60);
}

}  // namespace kiln

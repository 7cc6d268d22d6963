#include "train/metrics.h"

#include "core/error.h"
#include "core/json_number.h"
#include "io/durable_io.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>

namespace kiln {

namespace {

// One record's line. Strings may hold invalid UTF-8 (a byte model's sample can cut a
// character, a path is bytes): replaced, not thrown on.
std::string line_of(const nlohmann::json& record) {
  return record.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + '\n';
}

}  // namespace

MetricsLog::MetricsLog(const std::string& path, bool stop_on_error) : file_("metrics", path, stop_on_error) {}

void MetricsLog::step(const StepMetrics& m) {
  nlohmann::json j = {{"kind", "train"},         {"step", m.step},          {"loss", m.loss},
                      {"lr", m.lr},              {"grad_norm", m.grad_norm}, {"tokens", m.tokens},
                      {"target_tokens", m.target_tokens}, {"document_tokens", m.document_tokens},
                      {"step_seconds", m.step_seconds},
                      {"elapsed_seconds", m.elapsed_seconds}};
  for (const auto& [name, value] : m.terms) j[name] = value;
  for (const auto& [name, value] : m.components) j[name] = value;
  if (m.loss_scale > 0) j["loss_scale"] = m.loss_scale;
  if (!m.skipped.empty()) j["skipped"] = m.skipped;
  if (m.skipped_total > 0) j["skipped_total"] = m.skipped_total;
  j["window_steps"] = m.window_steps;
  if (std::isfinite(m.mfu)) j["mfu"] = m.mfu;
  if (m.device_memory_used_bytes > 0) j["device_memory_used_bytes"] = m.device_memory_used_bytes;
  j["host_peak_rss_bytes"] = m.host_peak_rss_bytes;
  file_.append(line_of(j));
}

void MetricsLog::validation(int64_t step, double loss, double elapsed_seconds) {
  file_.append(line_of({{"kind", "validation"}, {"step", step}, {"loss", loss}, {"elapsed_seconds", elapsed_seconds}}));
}

void MetricsLog::sample(int64_t step, const std::string& text) {
  file_.append(line_of({{"kind", "sample"}, {"step", step}, {"text", text}}));
}

void MetricsLog::skip(int64_t step, const std::string& reason, double loss, double grad_norm) {
  file_.append(line_of({{"kind", "skip"},
                        {"step", step},
                        {"reason", reason},
                        {"loss", json_number(loss)},
                        {"grad_norm", json_number(grad_norm)}}));
}

void MetricsLog::checkpoint(int64_t step, const std::string& path, double seconds) {
  file_.append(line_of({{"kind", "checkpoint"}, {"step", step}, {"path", path}, {"seconds", seconds}}));
}

void MetricsLog::resume(int64_t step, const std::string& path) {
  file_.append(line_of({{"kind", "resume"}, {"step", step}, {"path", path}}));
}

void MetricsLog::scalars(int64_t step, const std::string& kind, const NamedValues& values) {
  nlohmann::json j = {{"kind", kind}, {"step", step}};
  for (const auto& [name, value] : values) {
    KILN_CHECK(name != "kind" && name != "step", "metrics", "a '{}' record's value named '{}' would hide the record's own",
               kind, name);
    j[name] = value;
  }
  file_.append(line_of(j));
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

void set_aside_earlier_metrics(const std::string& path) {
  std::error_code error;
  if (std::filesystem::file_size(path, error) == 0 || error) return;  // none, or empty
  const std::string previous = path + ".previous";
  std::filesystem::rename(path, previous, error);
  if (error) fail("metrics", "{}: holds an earlier run's records and cannot be moved to {}: {}", path, previous, error.message());
  fmt::print("metrics: {} held an earlier run's records: moved to {} (a fresh run starts a new file; --resume "
             "continues one)\n",
             path, previous);
}

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const int64_t s = static_cast<int64_t>(seconds + 0.5);
  if (s < 60) return fmt::format("{}s", s);
  if (s < 3600) return fmt::format("{}m{:02}s", s / 60, s % 60);
  return fmt::format("{}h{:02}m", s / 3600, (s % 3600) / 60);
}

}  // namespace kiln

#include "train/metrics.h"

#include "core/error.h"
#include "io/durable_io.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <fcntl.h>
#include <filesystem>
#include <fstream>
#include <unistd.h>

namespace kiln {

MetricsLog::MetricsLog(const std::string& path, bool stop_on_error) : path_(path), stop_on_error_(stop_on_error) {
  if (path.empty()) return;  // records nothing
  fd_ = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) fail("metrics", "{}: cannot open for writing: {}", path, std::strerror(errno));
}

MetricsLog::~MetricsLog() {
  if (fd_ >= 0) ::close(fd_);
}

void MetricsLog::append(const std::string& line) {
  if (failed_ || fd_ < 0) return;
  size_t done = 0;
  while (done < line.size()) {
    const ssize_t n = ::write(fd_, line.data() + done, line.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const std::string cause = n < 0 ? std::strerror(errno) : "nothing written";
      if (stop_on_error_) fail("metrics", "{}: write failed: {} (checkpoint.on_save_error = stop)", path_, cause);
      failed_ = true;
      warn("metrics", fmt::format("{}: write failed: {}; checkpoint.on_save_error = continue: training goes on, "
                                  "without further metrics records",
                                  path_, cause));
      return;
    }
    done += static_cast<size_t>(n);
  }
}

void MetricsLog::step(const StepMetrics& m) {
  nlohmann::json j = {{"kind", "train"},         {"step", m.step},          {"loss", m.loss},
                      {"lr", m.lr},              {"grad_norm", m.grad_norm}, {"tokens", m.tokens},
                      {"target_tokens", m.target_tokens}, {"document_tokens", m.document_tokens},
                      {"step_seconds", m.step_seconds},
                      {"elapsed_seconds", m.elapsed_seconds}};
  for (const auto& [name, value] : m.terms) j[name] = value;
  for (const auto& [name, value] : m.components) j[name] = value;
  if (!m.skipped.empty()) j["skipped"] = m.skipped;
  if (m.skipped_total > 0) j["skipped_total"] = m.skipped_total;
  append(j.dump() + '\n');
}

void MetricsLog::validation(int64_t step, double loss, double elapsed_seconds) {
  append(nlohmann::json{{"kind", "validation"}, {"step", step}, {"loss", loss}, {"elapsed_seconds", elapsed_seconds}}
             .dump() +
         '\n');
}

void MetricsLog::sample(int64_t step, const std::string& text) {
  // Samples may hold invalid UTF-8 (a byte model can cut a character): replace, not throw.
  append(nlohmann::json{{"kind", "sample"}, {"step", step}, {"text", text}}.dump(
             -1, ' ', false, nlohmann::json::error_handler_t::replace) +
         '\n');
}

void MetricsLog::skip(int64_t step, const std::string& reason, double loss, double grad_norm) {
  // JSON has no NaN or Inf: non-finite values are written as null.
  auto number = [](double x) { return std::isfinite(x) ? nlohmann::json(x) : nlohmann::json(nullptr); };
  append(nlohmann::json{{"kind", "skip"}, {"step", step}, {"reason", reason}, {"loss", number(loss)},
                        {"grad_norm", number(grad_norm)}}
             .dump() +
         '\n');
}

void MetricsLog::checkpoint(int64_t step, const std::string& path, double seconds) {
  append(nlohmann::json{{"kind", "checkpoint"}, {"step", step}, {"path", path}, {"seconds", seconds}}.dump() + '\n');
}

void MetricsLog::resume(int64_t step, const std::string& path) {
  append(nlohmann::json{{"kind", "resume"}, {"step", step}, {"path", path}}.dump() + '\n');
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

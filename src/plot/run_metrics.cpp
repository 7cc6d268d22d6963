#include "plot/run_metrics.h"

#include "core/error.h"
#include "core/json_field.h"
#include "core/printable.h"
#include "core/small_file.h"
#include "io/durable_io.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

// Debian's libtomlplusplus-dev ships <toml++/toml.h>; upstream also has toml.hpp.
#if __has_include(<toml++/toml.hpp>)
#include <toml++/toml.hpp>
#else
#include <toml++/toml.h>
#endif

#include <algorithm>
#include <filesystem>
#include <limits>

namespace kiln::plot {

namespace fs = std::filesystem;

namespace {

constexpr const char* kWhere = "plot";
constexpr const char* kDefaultMetricsFile = "metrics.jsonl";
constexpr size_t kMaxConfigBytes = 1 << 20;

// A value the trainer writes as null when it is not finite (a skipped step's loss).
double number_or_nan(const JsonField& record, std::string_view key) {
  const JsonField field = record.member(key);
  return field.is_null() ? std::nan("") : field.number();
}

int64_t step_of(const JsonField& record) {
  return record.member("step").integer(0, std::numeric_limits<int64_t>::max());
}

TrainPoint train_point(const JsonField& record, double tokens_before) {
  TrainPoint p;
  p.step = step_of(record);
  p.loss = number_or_nan(record, "loss");
  p.lr = number_or_nan(record, "lr");
  p.grad_norm = number_or_nan(record, "grad_norm");
  // `tokens`, `document_tokens` and `step_seconds` are the log window's (train/trainer.cpp).
  const auto tokens = static_cast<double>(record.member("tokens").integer(0, std::numeric_limits<int64_t>::max()));
  p.tokens = tokens_before + tokens;
  const double seconds = record.member("step_seconds").number();
  if (seconds > 0) {
    p.tokens_per_second = tokens / seconds;
    // Older files have no document_tokens (kiln before issue 23.5).
    if (const auto documents = record.find("document_tokens"))
      p.document_tokens_per_second =
          static_cast<double>(documents->integer(0, std::numeric_limits<int64_t>::max())) / seconds;
  }
  return p;
}

// Drops what comes after `step`: the records a resume at `step` replaces.
void drop_after(RunMetrics& run, int64_t step) {
  std::erase_if(run.train, [&](const TrainPoint& p) { return p.step > step; });
  std::erase_if(run.validation, [&](const ValidationPoint& p) { return p.step > step; });
  std::erase_if(run.skipped_steps, [&](int64_t s) { return s > step; });
}

}  // namespace

double RunMetrics::tokens_at(int64_t step) const {
  if (train.empty()) return 0;
  auto right = std::lower_bound(train.begin(), train.end(), step,
                                [](const TrainPoint& p, int64_t s) { return p.step < s; });
  if (right != train.end() && right->step == step) return right->tokens;
  if (right == train.end()) --right;  // after the last record: at the last window's rate
  static const TrainPoint origin;     // before the first: from step 0, no tokens
  const TrainPoint& left = right == train.begin() ? origin : *(right - 1);
  const double per_step = (right->tokens - left.tokens) / static_cast<double>(std::max<int64_t>(right->step - left.step, 1));
  return left.tokens + per_step * static_cast<double>(step - left.step);
}

RunMetrics parse_metrics(std::string_view text, const std::string& file) {
  RunMetrics run;
  run.file = file;
  int64_t line_number = 0;
  size_t begin = 0;
  while (begin < text.size()) {
    const size_t end = text.find('\n', begin);
    const bool complete = end != std::string_view::npos;
    const std::string_view line = text.substr(begin, complete ? end - begin : std::string_view::npos);
    begin = complete ? end + 1 : text.size();
    ++line_number;
    if (line.find_first_not_of(" \t\r") == std::string_view::npos) continue;
    const auto json = nlohmann::json::parse(line, nullptr, false);
    if (json.is_discarded() || !json.is_object()) {
      if (!complete) break;  // being written, or torn by a crash
      fail(kWhere, "{}:{}: not a JSON object: {}", file, line_number, printable(line, 40));
    }
    const std::string where = fmt::format("{}:{}", file, line_number);
    const JsonField record(json, kWhere, where);
    const std::string& kind = record.member("kind").string();
    if (kind == "train") {
      TrainPoint p = train_point(record, run.train.empty() ? 0 : run.train.back().tokens);
      if (!run.train.empty() && p.step <= run.train.back().step)
        fail(kWhere, "{}: step {} follows step {} with no resume record between: two runs' records in one file?",
             where, p.step, run.train.back().step);
      run.train.push_back(p);
    } else if (kind == "validation") {
      run.validation.push_back({step_of(record), 0, number_or_nan(record, "loss")});
    } else if (kind == "skip") {
      run.skipped_steps.push_back(step_of(record));
    } else if (kind == "resume") {
      drop_after(run, step_of(record));
    }
  }
  if (run.train.empty() && run.validation.empty()) fail(kWhere, "{}: no train or validation records", file);
  for (ValidationPoint& v : run.validation) v.tokens = run.tokens_at(v.step);
  return run;
}

std::string metrics_file_of(const std::string& run) {
  std::error_code error;
  const fs::file_status status = fs::status(run, error);
  if (!fs::exists(status)) fail(kWhere, "{}: no such run directory or metrics file", run);
  if (!fs::is_directory(status)) return run;
  std::string name = kDefaultMetricsFile;
  const fs::path config = fs::path(run) / "config.toml";  // the run's resolved configuration
  if (fs::exists(config, error)) {
    const std::string text = read_small_file(config.string(), kMaxConfigBytes, "config file", kWhere);
    try {
      const toml::table root = toml::parse(text, config.string());
      if (const auto configured = root["log"]["metrics_file"].value<std::string>()) name = *configured;
    } catch (const toml::parse_error& e) {
      fail(kWhere, "{}:{}:{}: {}", config.string(), e.source().begin.line, e.source().begin.column,
           printable(e.description(), 200));
    }
  }
  const fs::path metrics = fs::path(run) / name;
  if (!fs::exists(metrics, error))
    fail(kWhere, "{}: no metrics file ({} not found): is it a run's train.out_dir?", run, metrics.string());
  return metrics.string();
}

std::string run_label(const std::string& run) {
  fs::path path = fs::absolute(run).lexically_normal();
  if (path.filename().empty()) path = path.parent_path();  // "runs/a/"
  std::error_code error;
  if (fs::is_directory(path, error)) return path.filename().string();
  if (path.filename() == kDefaultMetricsFile) return path.parent_path().filename().string();
  return path.stem().string();
}

RunMetrics read_metrics_file(const std::string& file) {
  std::error_code error;
  if (!fs::is_regular_file(file, error)) fail(kWhere, "{}: not a regular file", file);
  return parse_metrics(io::read_file_bytes(file, kWhere), file);
}

RunMetrics read_run_metrics(const std::string& run) {
  RunMetrics metrics = read_metrics_file(metrics_file_of(run));
  metrics.label = run_label(run);
  return metrics;
}

}  // namespace kiln::plot

#include "train/tensorboard_log.h"

#include "core/error.h"

#include <fmt/format.h>

#include <cmath>
#include <filesystem>

namespace kiln {

namespace fs = std::filesystem;

namespace {

// A component's metric under its own group: "moe.3.load_max" -> "moe/3/load_max".
std::string component_tag(std::string name) {
  for (char& c : name)
    if (c == '.') c = '/';
  return name;
}

// Markdown (the text plugin renders it) that shows `text` as it is: an indented code block
// keeps line breaks and leaves *, # and _ alone, and no line of the text can end it.
std::string verbatim_markdown(const std::string& text) {
  std::string out = "    ";
  for (const char c : text) {
    out += c;
    if (c == '\n') out += "    ";
  }
  return out;
}

bool holds_event_files(const std::string& dir) {
  std::error_code error;
  for (const auto& entry : fs::directory_iterator(dir, error))
    if (entry.path().filename().string().find("tfevents") != std::string::npos) return true;
  return false;
}

}  // namespace

TensorBoardLog::TensorBoardLog(const std::string& path, int64_t first_step, bool stop_on_error)
    : events_(path, stop_on_error) {
  // Every invocation starts a session, as TensorFlow's writers did: TensorBoard's server
  // takes a run's first start as its beginning and each later one as a restart, dropping
  // the events it has read at that step and later (the crashed run's past its checkpoint;
  // the checkpoint's own step was logged before the save, and is not run again).
  events_.session_start(first_step);
}

void TensorBoardLog::step(const StepMetrics& m) {
  NamedValues v = {{"train/loss", m.loss}};
  for (const auto& [name, value] : m.terms) v.emplace_back("train/" + name, value);
  if (m.loss_scale > 0) v.emplace_back("train/loss_scale", m.loss_scale);
  v.insert(v.end(), {{"train/lr", m.lr},
                     {"train/grad_norm", m.grad_norm},
                     {"perf/tokens_per_second", m.tokens_per_second()},
                     {"perf/document_tokens_per_second", m.document_tokens_per_second()},
                     {"perf/step_seconds", m.step_seconds / static_cast<double>(std::max<int64_t>(m.window_steps, 1))},
                     {"perf/elapsed_seconds", m.elapsed_seconds},
                     {"tokens/positions", static_cast<double>(m.tokens)},
                     {"tokens/documents", static_cast<double>(m.document_tokens)},
                     {"tokens/targets", static_cast<double>(m.target_tokens)},
                     {"memory/host_peak_rss_bytes", static_cast<double>(m.host_peak_rss_bytes)},
                     {"skips/total", static_cast<double>(m.skipped_total)}});
  if (std::isfinite(m.mfu)) v.emplace_back("perf/mfu", m.mfu);
  if (m.device_memory_used_bytes > 0)
    v.emplace_back("memory/device_used_bytes", static_cast<double>(m.device_memory_used_bytes));
  for (const auto& [name, value] : m.components) v.emplace_back(component_tag(name), value);
  events_.scalars(m.step, v);
}

void TensorBoardLog::validation(int64_t step, double loss, double /*elapsed_seconds: the event's wall time*/) {
  events_.scalars(step, {{"val/loss", loss}});
}

void TensorBoardLog::sample(int64_t step, const std::string& text) {
  events_.text(step, "sample/text", verbatim_markdown(text));
}

void TensorBoardLog::skip(int64_t step, const std::string& reason, double loss, double grad_norm) {
  events_.scalars(step, {{"skips/loss", loss}, {"skips/grad_norm", grad_norm}});
  events_.text(step, "skips/reason", verbatim_markdown(reason));
}

void TensorBoardLog::checkpoint(int64_t step, const std::string& /*path*/, double seconds) {
  events_.scalars(step, {{"checkpoint/save_seconds", seconds}});
}

void TensorBoardLog::resume(int64_t /*step*/, const std::string& /*path*/) {
  // Nothing more: the file's session start (the constructor's) marks the restart.
}

void TensorBoardLog::scalars(int64_t step, const std::string& kind, const NamedValues& values) {
  NamedValues tagged;
  for (const auto& [name, value] : values) tagged.emplace_back(kind + "/" + name, value);
  events_.scalars(step, tagged);
}

std::string prepare_tensorboard_dir(const std::string& dir, bool resumed) {
  std::error_code error;
  if (!resumed && holds_event_files(dir)) {
    const std::string previous = dir + ".previous";
    fs::remove_all(previous, error);
    if (!error) fs::rename(dir, previous, error);
    if (error)
      fail("tensorboard", "{}: holds an earlier run's event files and cannot be moved to {}: {}", dir, previous,
           error.message());
    fmt::print("tensorboard: {} held an earlier run's event files: moved to {} (a fresh run starts a new directory; "
               "--resume continues one)\n",
               dir, previous);
  }
  fs::create_directories(dir, error);
  if (error) fail("tensorboard", "{}: cannot create the directory: {}", dir, error.message());
  return io::new_event_file_path(dir);
}

}  // namespace kiln

// Per-step measurements, the console line and the JSONL metrics file.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace kiln {

struct StepMetrics {
  int64_t step = 0;            // 1-based, after the update
  int64_t total_steps = 0;
  double loss = 0;             // mean cross-entropy over the step's target tokens (nats)
  // The other reported loss terms (nn/loss_terms.h) by name, each a mean per target token:
  // "z" (logsumexp^2) when train.z_loss > 0, router losses, ...
  std::vector<std::pair<std::string, double>> terms;
  // The components' diagnostics of the step (Model::component_metrics: an MoE layer's load).
  std::vector<std::pair<std::string, double>> components;
  double lr = 0;
  double grad_norm = 0;        // before clipping
  int64_t tokens = 0;          // positions processed (incl. PAD)
  int64_t document_tokens = 0; // of them, documents' tokens (PAD left out): the real throughput
  int64_t target_tokens = 0;   // tokens with a loss
  double step_seconds = 0;
  double elapsed_seconds = 0;
  std::string skipped;         // why the update was skipped (fault guard), "" when applied
  int64_t skipped_total = 0;   // skipped updates so far in the run
};

// Appends one JSON line per record. Every write is checked: a failure (a full disk, a
// file-size limit) follows checkpoint.on_save_error, like a failed save. With stop_on_error
// it throws "[metrics] PATH: write failed: ..."; otherwise one warning says so and later
// records are dropped (the run goes on; the file keeps what was written before).
class MetricsLog {
 public:
  // An empty path records nothing (the ranks other than 0 of a multi-process run).
  MetricsLog(const std::string& path, bool stop_on_error);
  ~MetricsLog();
  MetricsLog(const MetricsLog&) = delete;
  MetricsLog& operator=(const MetricsLog&) = delete;
  void step(const StepMetrics& m);
  void validation(int64_t step, double loss, double elapsed_seconds);
  void sample(int64_t step, const std::string& text);
  // A step whose update the fault guard skipped (the loss may be NaN: written as null).
  void skip(int64_t step, const std::string& reason, double loss, double grad_norm);
  void checkpoint(int64_t step, const std::string& path, double seconds);
  void resume(int64_t step, const std::string& path);
  const std::string& path() const { return path_; }

 private:
  void append(const std::string& line);  // `line` ends with '\n'

  std::string path_;
  bool stop_on_error_;
  int fd_ = -1;
  bool failed_ = false;  // a write failed (continue mode): records are dropped from then on
};

// Before a resumed run appends: drops the records of steps after `step` (the crashed
// run got further than its checkpoint) and a torn last line, so the file reads as if
// the run never stopped. Rewritten atomically; a missing file is left missing.
void truncate_metrics_after(const std::string& path, int64_t step);

// Before a fresh (not resumed) run writes its first record: an earlier run's records in
// `path` are moved to `path`.previous (replacing an older one), with a note, so the new
// file holds one run and nothing of the old one is lost unannounced.
void set_aside_earlier_metrics(const std::string& path);

// "4m12s", "1h03m", "12s".
std::string format_duration(double seconds);

}  // namespace kiln

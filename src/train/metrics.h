// The JSONL metrics file (<train.out_dir>/<log.metrics_file>), one of a run's record
// sinks, and its upkeep across runs.
#pragma once

#include "io/record_file.h"
#include "train/run_records.h"

#include <cstdint>
#include <string>

namespace kiln {

// metrics.jsonl: one JSON line per record, "kind" naming it ("train", "validation",
// "sample", "skip", "checkpoint", "resume", or a scalars() record's kind). Write failures
// follow checkpoint.on_save_error (io/record_file.h): "[metrics] PATH: write failed: ...".
class MetricsLog final : public RunRecordSink {
 public:
  MetricsLog(const std::string& path, bool stop_on_error);

  void step(const StepMetrics& m) override;
  void validation(int64_t step, double loss, double elapsed_seconds) override;
  void sample(int64_t step, const std::string& text) override;
  // Non-finite losses and norms are written as null (JSON has no NaN or Inf).
  void skip(int64_t step, const std::string& reason, double loss, double grad_norm) override;
  void checkpoint(int64_t step, const std::string& path, double seconds) override;
  void resume(int64_t step, const std::string& path) override;
  // {"kind": kind, "step": step, name: value, ...}; no name may be "kind" or "step".
  void scalars(int64_t step, const std::string& kind, const NamedValues& values) override;
  const std::string& path() const { return file_.path(); }

 private:
  io::RecordFile file_;
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

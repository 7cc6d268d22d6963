// TensorBoard event files of a run (log.tensorboard), one of its record sinks: every
// number metrics.jsonl records, as scalars under the tags docs/metrics.md lists
// ("train/loss", "val/loss", "moe/3/load_max", ...), and the samples as text. One new
// event file per run invocation in <train.out_dir>/<log.tensorboard_dir>, starting with a
// session start at the first step the invocation trains: for a resumed run, a restart, on
// which TensorBoard drops what the crashed run logged past the checkpoint, as
// metrics.jsonl is cut back.
#pragma once

#include "io/tensorboard/event_file.h"
#include "train/run_records.h"

#include <string>

namespace kiln {

class TensorBoardLog final : public RunRecordSink {
 public:
  // Writes to the event file `path` (io::new_event_file_path), first a session start at
  // `first_step` (1, or the step after a resumed checkpoint's). Write failures follow
  // checkpoint.on_save_error as "[tensorboard] PATH: write failed: ...".
  TensorBoardLog(const std::string& path, int64_t first_step, bool stop_on_error);

  void step(const StepMetrics& m) override;
  void validation(int64_t step, double loss, double elapsed_seconds) override;
  void sample(int64_t step, const std::string& text) override;
  void skip(int64_t step, const std::string& reason, double loss, double grad_norm) override;
  void checkpoint(int64_t step, const std::string& path, double seconds) override;
  void resume(int64_t step, const std::string& path) override;
  void scalars(int64_t step, const std::string& kind, const NamedValues& values) override;
  const std::string& path() const { return events_.path(); }

 private:
  io::EventFileWriter events_;
};

// The TensorBoard directory `dir` made ready for a run's new event file, whose path it
// returns. Before a fresh (not resumed) run, an earlier run's event files are moved with
// their directory to `dir`.previous (replacing an older one), with a note, as
// metrics.jsonl is set aside: the new directory holds one run, the old one stays readable
// (`tensorboard --logdir <out_dir>` shows both).
std::string prepare_tensorboard_dir(const std::string& dir, bool resumed);

}  // namespace kiln

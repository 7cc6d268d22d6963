// The run's summary (<train.out_dir>/summary.json), written when a run ends: what a user
// or a sweep script wants without reading metrics.jsonl (the best validation loss and its
// step, tokens, time, throughput, final losses, skipped updates).
#pragma once

#include <cmath>
#include <cstdint>
#include <string>

namespace kiln {

// The lowest validation loss so far and its step (loss NaN, step 0: none yet).
struct BestValidation {
  double loss = std::nan("");
  int64_t step = 0;
  // Takes `loss` at `step` when it is finite and lower.
  void offer(double value, int64_t at) {
    if (std::isfinite(value) && (std::isnan(loss) || value < loss)) loss = value, step = at;
  }
};

// The best of the validation records in a metrics file (a resumed run continues the
// earlier runs' best; the file was truncated to the resume step). None for a missing file.
BestValidation best_validation_in(const std::string& metrics_path);

struct RunSummary {
  int64_t steps = 0, total_steps = 0;
  int64_t tokens = 0, target_tokens = 0;  // positions processed (PAD included), and with a loss
  int64_t document_tokens = 0;            // positions holding a document's token
  double document_tokens_per_second = 0;  // of this run's steps: the real throughput
  double seconds = 0;                     // this run's wall time
  double elapsed_seconds = 0;             // every run's, up to the end
  double tokens_per_second = 0;           // of this run's steps
  double final_train_loss = 0, final_validation_loss = 0;  // NaN: none
  BestValidation best;
  int64_t skipped_steps = 0;
  std::string stopped_by;  // "" or the signal that ended the run's end-of-run work early
};

// Writes `summary` as JSON to `path`, atomically (a reader never sees half a file); NaN
// values are written as null.
void write_run_summary(const std::string& path, const RunSummary& summary);

}  // namespace kiln

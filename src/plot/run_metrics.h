// A run's metrics file (train/metrics.h writes it: one JSON record a line) read back as
// the series `kiln plot` draws. Errors are one line naming the file and the line:
//   [plot] runs/a/metrics.jsonl:12: not a JSON object: {"kind": "tr
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace kiln::plot {

// One train record: the mean over its log window (log.every steps) ending at `step`.
struct TrainPoint {
  int64_t step = 0;
  double tokens = 0;                             // positions trained up to and including `step`, every window's
  double loss = std::nan("");                    // NaN: every step of the window was skipped
  double lr = std::nan("");
  double grad_norm = std::nan("");               // NaN: not finite (the fault guard skipped the step)
  double tokens_per_second = std::nan("");       // positions (PAD included) over the window's time
  double document_tokens_per_second = std::nan("");  // documents' tokens only; NaN when the record has none
};

struct ValidationPoint {
  int64_t step = 0;
  double tokens = 0;  // positions trained before this validation
  double loss = std::nan("");
};

struct RunMetrics {
  std::string label;  // the run's name in a legend
  std::string file;   // the metrics file read
  std::vector<TrainPoint> train;
  std::vector<ValidationPoint> validation;
  std::vector<int64_t> skipped_steps;  // updates the fault guard skipped
  // Positions trained by `step`: the train records' windows summed, linear between two
  // records (each step trains the same number of positions).
  double tokens_at(int64_t step) const;
};

// The metrics file of RUN: RUN itself when it is a file, else in the run directory
// (train.out_dir) the file its config.toml's log.metrics_file names, metrics.jsonl by
// default. Throws "[plot] RUN: ..." when there is none.
std::string metrics_file_of(const std::string& run);

// The name a legend gives RUN: its directory's ("runs/lr-3e-3/" -> "lr-3e-3"; a metrics
// file named otherwise than metrics.jsonl: its stem).
std::string run_label(const std::string& run);

// Reads RUN's metrics (metrics_file_of(RUN)), labelled run_label(RUN).
RunMetrics read_run_metrics(const std::string& run);

// Reads the metrics file `file` (parse_metrics), unlabelled. Anything but a regular file
// (a device, a pipe: read without end) is refused: "[plot] FILE: not a regular file".
RunMetrics read_metrics_file(const std::string& file);

// The records in `text` as the lines of `file` (named in errors). A resume record drops
// the records after its step (they would be the crashed run's, had the file not been cut
// back), so a resumed run reads as one; a record of a step not after the one before it,
// without a resume between, is two runs in one file and an error. Records of other kinds
// (sample, checkpoint) are passed over. A last line without its newline that is no JSON
// is a record still being written (a live run) or torn by a crash, and is left out.
RunMetrics parse_metrics(std::string_view text, const std::string& file);

}  // namespace kiln::plot

// Where a training run writes, checked against what it reads before anything is read or
// written: train.out_dir apart from the training data, and every file kiln writes in the
// run directory (config.toml, the metrics file, TensorBoard's directory, model/, ...)
// neither one of its inputs nor another of its own files.
#pragma once

#include "config/config.h"

#include <string>
#include <vector>

namespace kiln {

// The run directory's lock file (train/run_directory.h) and run id file.
inline constexpr const char* kRunLockFile = "kiln.lock";
inline constexpr const char* kRunIdFile = "run_id";

// A path kiln writes in a run, and what names it in a message ("log.metrics_file",
// "the run's config.toml").
struct RunOutput {
  std::string path;
  std::string name;
};

// Everything the run of `config` writes or replaces, by path: its files in train.out_dir
// and the checkpoint directory.
std::vector<RunOutput> run_outputs(const Config& config);

// Throws a one-line error naming the keys when train.out_dir or checkpoint.dir is, lies
// inside or contains data.path or data.val_path; when log.metrics_file or
// log.tensorboard_dir leaves train.out_dir or names another of the run's own files; and
// when an output is or contains an input (data, tokenizer, eval files).
void check_run_paths(const Config& config);

}  // namespace kiln

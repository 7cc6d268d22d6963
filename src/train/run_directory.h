// A run directory (train.out_dir) holds one run. A fresh run never writes over another
// run's files: it is refused, naming --resume and --overwrite, and --overwrite removes
// the earlier run's files (kiln's own, nothing else) just before the new run writes its
// first one. A second kiln process is kept out by an exclusive lock for the run's
// lifetime. Each run has a random id, kept in DIR/run_id and in every checkpoint, so that
// --resume never continues another run's checkpoint.
#pragma once

#include "config/config.h"

#include <string>
#include <vector>

namespace kiln {

class RunDirectory {
 public:
  // Takes flock(LOCK_EX) on DIR/kiln.lock (which then holds this process's pid); the lock
  // goes with the process, so a crash leaves none behind. Throws "[train.out_dir] DIR: in
  // use by another kiln run (pid N) ..." when another process holds it.
  explicit RunDirectory(const Config& config);
  ~RunDirectory();
  RunDirectory(const RunDirectory&) = delete;
  RunDirectory& operator=(const RunDirectory&) = delete;

  // kiln's files of an earlier run found in the run and checkpoint directories (empty
  // directories left out).
  std::vector<std::string> earlier_run_files() const;
  // A fresh run: throws naming --resume and --overwrite when an earlier run is there and
  // `overwrite` is false.
  void check_fresh_start(bool overwrite) const;
  // --overwrite: removes the earlier run's files; other files are left where they are.
  void remove_earlier_run() const;
  // A restart with --resume that found no checkpoint: refused when the directory holds a
  // finished run (summary.json), which the restart would replace.
  void check_restart_without_checkpoint() const;

  // The id in DIR/run_id; "" when there is none (a new directory, or an older kiln's).
  std::string run_id() const;
  void write_run_id(const std::string& id) const;

 private:
  Config config_;
  int lock_fd_ = -1;
};

// 16 random hex digits.
std::string new_run_id();

// Refuses a checkpoint of another run: `checkpoint_run` (its state's id) and `dir_run`
// (the run directory's) differ while both are known. Checkpoints of older kilns carry no
// id and are accepted.
void check_same_run(const std::string& checkpoint, const std::string& checkpoint_run, const std::string& out_dir,
                    const std::string& dir_run);

}  // namespace kiln

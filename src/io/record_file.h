// An append-only file of a run's records (metrics.jsonl, a TensorBoard event file). Every
// write is checked: a failure (a full disk, a file-size limit) follows
// checkpoint.on_save_error, like a failed save. With stop_on_error it throws
// "[WHERE] PATH: write failed: ... (checkpoint.on_save_error = stop)"; otherwise one
// warning says so and later records are dropped (the run goes on; the file keeps what was
// written before).
#pragma once

#include <string>
#include <string_view>

namespace kiln::io {

class RecordFile {
 public:
  // Opens (creates) `path` for appending; `where` names the writer in messages
  // ("metrics", "tensorboard"). An unopenable path is an error whatever the policy.
  RecordFile(std::string where, std::string path, bool stop_on_error);
  ~RecordFile();
  RecordFile(const RecordFile&) = delete;
  RecordFile& operator=(const RecordFile&) = delete;

  // Writes `bytes` whole, or fails as above (a record torn by a failure is left torn).
  void append(std::string_view bytes);
  const std::string& path() const { return path_; }

 private:
  std::string where_, path_;
  bool stop_on_error_;
  int fd_ = -1;
  bool failed_ = false;  // a write failed (continue mode): records are dropped from then on
};

}  // namespace kiln::io

// A TensorBoard event file, written as a run goes: TensorFlow's format (TFRecord-framed
// Event protos, io/tensorboard/event.proto), so TensorBoard and every reader of its files
// load it. Each event is written with one write(2), nothing buffered in the process: a
// TensorBoard watching the directory sees each step as it is logged.
#pragma once

#include "io/record_file.h"

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace kiln::io {

// The path of a new event file in `dir`: events.out.tfevents.<seconds>.<host>.<pid>.kiln
// (TensorBoard takes files whose name holds "tfevents"). TensorBoard reads a directory's
// event files in name order, so <seconds> is now, or one past the newest event file
// already in `dir` if that is later: a resumed run's file sorts after the file of the run
// it continues even when both started within one second.
std::string new_event_file_path(const std::string& dir);

class EventFileWriter {
 public:
  // Creates `path` and writes its first event (file_version "brain.Event:2", which makes
  // TensorBoard honour session_start). Write failures follow checkpoint.on_save_error:
  // "[tensorboard] PATH: write failed: ..." (io/record_file.h).
  EventFileWriter(const std::string& path, bool stop_on_error);

  // Tags and text are written as UTF-8 (TensorBoard's protos require it): an invalid byte
  // becomes U+FFFD.
  //
  // One event at `step` holding each (tag, value), as float32 simple values (TensorBoard's
  // scalars; NaN and infinities kept).
  void scalars(int64_t step, const std::vector<std::pair<std::string, double>>& values);
  // A text-plugin summary: `markdown` as a scalar string tensor.
  void text(int64_t step, const std::string& tag, const std::string& markdown);
  // A session start at `step`. TensorBoard's server takes a run's first one as its
  // beginning; at each later one (its event_accumulator module: at any) it drops the events
  // it has read with this step or a later one.
  void session_start(int64_t step);
  const std::string& path() const { return file_.path(); }

 private:
  RecordFile file_;
};

}  // namespace kiln::io

// A timeline of complete events on named tracks, written in the Chrome trace event format
// ({"traceEvents": [...], "displayTimeUnit": "ms"}) that Perfetto (ui.perfetto.dev) and
// chrome://tracing open. Each track is a thread of a process in that format: "kiln" with
// its "host phases" and "ops" tracks, "GPU 0" with one track per CUDA stream.
//
// Times are microseconds on one clock, the host's steady clock counted from the recorder's
// creation; whoever adds device times (CUDA events, CUPTI timestamps) converts them to it.
#pragma once

#include <nlohmann/json.hpp>

#include <chrono>
#include <string>
#include <vector>

namespace kiln {

struct TraceEvent {
  std::string name;
  std::string category;  // "phase", "op", "kernel", "memcpy", "memset"
  std::string process;   // the group of tracks: "kiln", "GPU 0"
  std::string track;     // within it: "host phases", "ops", "stream 7"
  double start_us = 0, duration_us = 0;
  nlohmann::json args;   // an object shown with the event, or null
};

class TraceRecorder {
 public:
  using Clock = std::chrono::steady_clock;

  TraceRecorder() : origin_(Clock::now()) {}

  double to_us(Clock::time_point t) const { return std::chrono::duration<double, std::micro>(t - origin_).count(); }
  double now_us() const { return to_us(Clock::now()); }

  void add(TraceEvent event) { events_.push_back(std::move(event)); }
  // A key of the trace's metadata ("otherData"), e.g. why it has no kernels.
  void set_metadata(const std::string& key, nlohmann::json value) { metadata_[key] = std::move(value); }

  const std::vector<TraceEvent>& events() const { return events_; }
  // Events of one category.
  size_t count(const std::string& category) const;

  // The whole trace: metadata events naming every process and track (in the order they
  // first appeared), then the events sorted by track, start, and longest first, so an
  // enclosing range precedes the ranges it holds.
  nlohmann::json to_json() const;
  // Throws Error naming `path` if it cannot be written.
  void write(const std::string& path) const;

 private:
  Clock::time_point origin_;
  std::vector<TraceEvent> events_;
  nlohmann::json metadata_ = nlohmann::json::object();
};

// The recorder that phase scopes (core/phase_scope.h) add to; null while no trace records.
TraceRecorder* active_trace();
void set_active_trace(TraceRecorder* trace);

}  // namespace kiln

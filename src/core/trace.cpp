#include "core/trace.h"

#include "core/error.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <tuple>
#include <utility>

namespace kiln {

namespace {

TraceRecorder* g_active = nullptr;

// Microseconds rounded to whole nanoseconds: the clocks resolve no finer, and the file
// reads 4787.604 rather than 4787.603999999999.
double to_nanoseconds(double us) { return std::round(us * 1e3) / 1e3; }

// Chrome's format names a track by a process id and a thread id; these are handed out in
// the order processes and tracks first appear, so the viewer lists them in that order.
class TrackIds {
 public:
  std::pair<int, int> of(const TraceEvent& e) {
    auto [process, fresh] = processes_.try_emplace(e.process, static_cast<int>(processes_.size()) + 1);
    if (fresh) metadata_.push_back(name_event("process_name", process->second, 0, e.process));
    const int pid = process->second;
    int& next_tid = next_tid_[pid];
    auto [track, new_track] = tracks_.try_emplace(std::pair(pid, e.track), next_tid + 1);
    if (new_track) {
      const int tid = ++next_tid;
      metadata_.push_back(name_event("thread_name", pid, tid, e.track));
      metadata_.push_back({{"name", "thread_sort_index"}, {"ph", "M"}, {"pid", pid}, {"tid", tid},
                           {"args", {{"sort_index", tid}}}});
    }
    return {pid, track->second};
  }
  const std::vector<nlohmann::json>& metadata() const { return metadata_; }

 private:
  static nlohmann::json name_event(const char* what, int pid, int tid, const std::string& name) {
    return {{"name", what}, {"ph", "M"}, {"pid", pid}, {"tid", tid}, {"args", {{"name", name}}}};
  }
  std::map<std::string, int> processes_;
  std::map<std::pair<int, std::string>, int> tracks_;
  std::map<int, int> next_tid_;
  std::vector<nlohmann::json> metadata_;
};

}  // namespace

size_t TraceRecorder::count(const std::string& category) const {
  return static_cast<size_t>(
      std::count_if(events_.begin(), events_.end(), [&](const TraceEvent& e) { return e.category == category; }));
}

nlohmann::json TraceRecorder::to_json() const {
  TrackIds ids;
  struct Placed {
    int pid, tid;
    const TraceEvent* event;
  };
  std::vector<Placed> placed;
  placed.reserve(events_.size());
  for (const TraceEvent& e : events_) {
    const auto [pid, tid] = ids.of(e);
    placed.push_back({pid, tid, &e});
  }
  std::stable_sort(placed.begin(), placed.end(), [](const Placed& a, const Placed& b) {
    return std::tuple(a.pid, a.tid, a.event->start_us, -a.event->duration_us) <
           std::tuple(b.pid, b.tid, b.event->start_us, -b.event->duration_us);
  });
  nlohmann::json events = nlohmann::json::array();
  for (const nlohmann::json& m : ids.metadata()) events.push_back(m);
  for (const Placed& p : placed) {
    const TraceEvent& e = *p.event;
    nlohmann::json j = {{"name", e.name}, {"cat", e.category},          {"ph", "X"},
                        {"pid", p.pid},   {"tid", p.tid},               {"ts", to_nanoseconds(e.start_us)},
                        {"dur", to_nanoseconds(e.duration_us)}};
    if (e.args.is_object() && !e.args.empty()) j["args"] = e.args;
    events.push_back(std::move(j));
  }
  return {{"traceEvents", std::move(events)}, {"displayTimeUnit", "ms"}, {"otherData", metadata_}};
}

void TraceRecorder::write(const std::string& path) const {
  std::ofstream out(path, std::ios::trunc);
  if (out) out << to_json().dump() << '\n';
  out.close();
  if (!out) fail("trace", "{}: cannot write: {}", path, std::strerror(errno));
}

TraceRecorder* active_trace() { return g_active; }
void set_active_trace(TraceRecorder* trace) { g_active = trace; }

}  // namespace kiln

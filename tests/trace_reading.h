// Reading back a Chrome trace that kiln wrote (core/trace.h), for the CPU suite
// (test_trace.cpp) and the GPU one (gpu/test_gpu_trace.cpp): its complete events with the
// names of their process and track resolved from the metadata events.
#pragma once

#include "test_util.h"

#include <nlohmann/json.hpp>

#include <map>
#include <string>
#include <utility>
#include <vector>

namespace kiln::test {

struct ReadEvent {
  std::string name, category, process, track;
  double start_us = 0, duration_us = 0;
  nlohmann::json args;
  double end_us() const { return start_us + duration_us; }
  bool within(const ReadEvent& outer) const { return start_us >= outer.start_us && end_us() <= outer.end_us(); }
};

inline std::vector<ReadEvent> complete_events(const nlohmann::json& trace) {
  std::map<int, std::string> processes;
  std::map<std::pair<int, int>, std::string> tracks;
  for (const nlohmann::json& e : trace.at("traceEvents")) {
    if (e.at("ph") != "M") continue;
    if (e.at("name") == "process_name") processes[e.at("pid")] = e.at("args").at("name");
    if (e.at("name") == "thread_name") tracks[{e.at("pid"), e.at("tid")}] = e.at("args").at("name");
  }
  std::vector<ReadEvent> out;
  for (const nlohmann::json& e : trace.at("traceEvents")) {
    if (e.at("ph") != "X") continue;
    const int pid = e.at("pid"), tid = e.at("tid");
    out.push_back({e.at("name"), e.at("cat"), processes.at(pid), tracks.at({pid, tid}), e.at("ts"), e.at("dur"),
                   e.value("args", nlohmann::json())});
  }
  return out;
}

// Ranges on one track must nest or follow each other, or a viewer misdraws them: the
// first pair that overlaps only partly, described ("" if none). `events` as read, sorted.
inline std::string partial_overlap(const std::vector<ReadEvent>& events) {
  std::map<std::pair<std::string, std::string>, std::vector<const ReadEvent*>> open;  // by track: enclosing ranges
  for (const ReadEvent& e : events) {
    std::vector<const ReadEvent*>& stack = open[{e.process, e.track}];
    while (!stack.empty() && stack.back()->end_us() <= e.start_us) stack.pop_back();
    if (!stack.empty() && e.end_us() > stack.back()->end_us())
      return stack.back()->name + " and " + e.name + " on " + e.track;
    stack.push_back(&e);
  }
  return "";
}

// The first event named `name` (fails the calling test if there is none).
inline ReadEvent event_named(const std::vector<ReadEvent>& events, const std::string& name) {
  for (const ReadEvent& e : events)
    if (e.name == name) return e;
  ADD_FAILURE() << "no event named \"" << name << "\" in the trace";
  return {};
}

}  // namespace kiln::test

// The trace recorder (core/trace.h), the phase scopes that add to it (core/phase_scope.h),
// the op profiler's scope list (core/op_profiler.h) and `kiln bench --trace` end to end on
// the CPU: phases inside the traced step, ops inside the phases, a file Perfetto reads.
#include "core/op_profiler.h"
#include "core/phase_scope.h"
#include "core/trace.h"
#include "test_util.h"
#include "trace_reading.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <set>
#include <string>
#include <thread>

namespace kiln {
namespace {

using test::complete_events;
using test::event_named;
using test::ReadEvent;

// A phase that lasts long enough for the steady clock to see.
void busy_phase(const char* name) {
  KILN_PHASE(name);
  std::this_thread::sleep_for(std::chrono::microseconds(200));
}

TEST(Trace, JsonNamesEveryTrackAndSortsEnclosingRangesFirst) {
  TraceRecorder trace;
  // Added out of order: the enclosed range first, another process's track in between.
  trace.add({"forward", "phase", "kiln", "host phases", 10, 5, nullptr});
  trace.add({"gemm", "kernel", "GPU 0", "stream 7", 12, 1, {{"grid", {4, 1, 1}}}});
  trace.add({"step", "phase", "kiln", "host phases", 10, 20, nullptr});
  trace.add({"matmul", "op", "kiln", "ops", 11, 2, nullptr});
  trace.set_metadata("kernels", "none: a test");
  const nlohmann::json j = nlohmann::json::parse(trace.to_json().dump());  // what a viewer parses

  EXPECT_EQ(j.at("displayTimeUnit"), "ms");
  EXPECT_EQ(j.at("otherData").at("kernels"), "none: a test");
  std::set<std::string> names;
  for (const nlohmann::json& e : j.at("traceEvents"))
    if (e.at("ph") == "M") names.insert(e.at("name").get<std::string>() + ":" + e.value("args", nlohmann::json()).value("name", ""));
  EXPECT_TRUE(names.count("process_name:kiln") && names.count("process_name:GPU 0")) << j.dump();
  EXPECT_TRUE(names.count("thread_name:host phases") && names.count("thread_name:ops") &&
              names.count("thread_name:stream 7"))
      << j.dump();

  const std::vector<ReadEvent> events = complete_events(j);
  ASSERT_EQ(events.size(), 4u);
  // Processes, then their tracks, in the order they first appeared; on a track, the
  // enclosing range first.
  EXPECT_EQ(events[0].name, "step");
  EXPECT_EQ(events[1].name, "forward");
  EXPECT_TRUE(events[1].within(events[0]));
  EXPECT_EQ(events[2].track, "ops");
  EXPECT_DOUBLE_EQ(events[2].start_us, 11);
  EXPECT_DOUBLE_EQ(events[2].duration_us, 2);
  EXPECT_EQ(events[3].process, "GPU 0");
  EXPECT_EQ(events[3].track, "stream 7");
  EXPECT_EQ(events[3].args.at("grid"), nlohmann::json({4, 1, 1}));
  for (const nlohmann::json& e : j.at("traceEvents"))
    if (e.at("ph") == "X") EXPECT_TRUE(e.contains("ts") && e.contains("dur") && e.contains("pid") && e.contains("tid"));
}

TEST(Trace, PhasesNestOnTheHostPhasesTrackOnlyWhileATraceRecords) {
  busy_phase("before");  // no trace: nothing to record to
  TraceRecorder trace;
  set_active_trace(&trace);
  {
    KILN_PHASE("step");
    busy_phase("forward");
    busy_phase("backward");
  }
  set_active_trace(nullptr);
  busy_phase("after");

  const std::vector<ReadEvent> events = complete_events(trace.to_json());
  ASSERT_EQ(events.size(), 3u);
  const ReadEvent step = event_named(events, "step"), forward = event_named(events, "forward"),
                  backward = event_named(events, "backward");
  for (const ReadEvent& e : {step, forward, backward}) {
    EXPECT_EQ(e.process, "kiln");
    EXPECT_EQ(e.track, "host phases");
    EXPECT_EQ(e.category, "phase");
    EXPECT_GT(e.duration_us, 100) << e.name;
  }
  EXPECT_TRUE(forward.within(step));
  EXPECT_TRUE(backward.within(step));
  EXPECT_GE(backward.start_us, forward.end_us());
}

TEST(Trace, OpScopesListedInOrderWithTheirDepth) {
  OpProfiler::set_enabled(true);
  OpProfiler::reset();
  {
    OpScope outer("outer", Device::cpu);
    std::this_thread::sleep_for(std::chrono::microseconds(200));
    OpScope inner("inner", Device::cpu);
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  const std::vector<OpInterval> scopes = OpProfiler::scopes();
  const std::vector<OpTime> totals = OpProfiler::collect();  // scopes() left them for it
  OpProfiler::set_enabled(false);
  OpProfiler::reset();
  ASSERT_EQ(scopes.size(), 2u);
  EXPECT_STREQ(scopes[0].op, "outer");
  EXPECT_EQ(scopes[0].depth, 0);
  EXPECT_STREQ(scopes[1].op, "inner");
  EXPECT_EQ(scopes[1].depth, 1);
  EXPECT_GE(scopes[0].milliseconds, 0.4);
  EXPECT_GE(scopes[1].start, scopes[0].start);
  EXPECT_LE(scopes[1].milliseconds, scopes[0].milliseconds);
  EXPECT_FALSE(scopes[0].device);
  EXPECT_EQ(totals.size(), 2u);
}

TEST(Trace, AFileThatCannotBeWrittenIsNamed) {
  TraceRecorder trace;
  const std::string path = "/nonexistent-kiln-dir/trace.json";
  EXPECT_NE(test::error_of([&] { trace.write(path); }).find(path + ": cannot write"), std::string::npos);
}

// bench-124m's layout at a size the CPU runs in well under a second a step.
const std::string kTinyBench =
    " --set model.layers=2 --set model.hidden=64 --set model.heads=4 --set model.kv_heads=4 --set model.head_dim=16"
    " --set model.ffn_hidden=128 --set model.vocab_size=512 --set model.max_seq_len=128"
    " --set train.micro_batch_tokens=256 --set train.loss_chunk_tokens=256 --set train.device=cpu"
    " --set train.precision=fp32 --steps 1 --warmup 0";

int bench(const std::string& extra, std::string* output) {
  return test::run_command(test::kiln_binary() + " bench " + test::source_dir() + "/configs/bench-124m.toml" +
                               kTinyBench + extra + " 2>&1",
                           output);
}

TEST(Trace, BenchTracesOneStepsPhasesAndOpsOnTheCpu) {
  const std::string dir = test::temp_dir("kiln-trace");
  const std::string path = dir + "/out.json";
  std::string out;
  ASSERT_EQ(bench(" --trace " + path, &out), 0) << out;
  EXPECT_NE(out.find("trace: " + path), std::string::npos) << out;
  const nlohmann::json j = nlohmann::json::parse(test::read_file(path));
  EXPECT_EQ(j.at("otherData").at("kernels").get<std::string>().rfind("none: ", 0), 0u) << j.at("otherData");
  const std::vector<ReadEvent> events = complete_events(j);
  EXPECT_EQ(test::partial_overlap(events), "");

  const ReadEvent step = event_named(events, "step (op by op)");
  EXPECT_GT(step.duration_us, 0);
  for (const ReadEvent& e : events) EXPECT_NE(e.name, "step (CUDA graph)") << "the CPU has no graphs";
  for (const char* phase : {"load batch", "forward", "loss", "backward", "gradient norm", "optimizer"}) {
    const ReadEvent p = event_named(events, phase);
    EXPECT_EQ(p.track, "host phases") << phase;
    EXPECT_GT(p.duration_us, 0) << phase;
    EXPECT_TRUE(p.within(step)) << phase;
  }
  const ReadEvent forward = event_named(events, "forward"), backward = event_named(events, "backward");
  EXPECT_GE(backward.start_us, forward.end_us());
  size_t ops = 0, in_forward = 0, in_backward = 0;
  for (const ReadEvent& e : events) {
    if (e.category != "op") continue;
    ++ops;
    EXPECT_EQ(e.track, "ops");
    EXPECT_GT(e.duration_us, 0) << e.name;
    EXPECT_TRUE(e.within(step)) << e.name;  // the CPU times ops on the host clock, as it does phases
    in_forward += e.within(forward);
    in_backward += e.within(backward);
  }
  EXPECT_GT(ops, 10u);
  EXPECT_GT(in_forward, 0u);
  EXPECT_GT(in_backward, 0u);
  std::filesystem::remove_all(dir);
}

TEST(Trace, BenchRefusesATraceFileItCannotWriteBeforeTheSteps) {
  std::string out;
  EXPECT_NE(bench(" --trace /nonexistent-kiln-dir/out.json", &out), 0);
  EXPECT_NE(out.find("--trace /nonexistent-kiln-dir/out.json: cannot write"), std::string::npos) << out;
  EXPECT_EQ(out.find("ms per step"), std::string::npos) << "refused before timing: " << out;
}

}  // namespace
}  // namespace kiln

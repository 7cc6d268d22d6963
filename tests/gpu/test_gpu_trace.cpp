// `kiln bench --trace` on the GPU: CUPTI's kernels on their stream tracks, each inside one
// of the two traced steps (op by op, then the replayed CUDA graphs) on the one clock the
// trace shares with the host phases and the ops' CUDA events.
#include "test_util.h"
#include "trace_reading.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <string>

namespace kiln {
namespace {

using test::complete_events;
using test::event_named;
using test::ReadEvent;

// How far the host and CUPTI clocks may disagree after the trace aligned them (both are
// read together; an idle device's reference event places the ops).
constexpr double kClockSlackUs = 20;

bool within_step(const ReadEvent& e, const ReadEvent& step) {
  return e.start_us >= step.start_us - kClockSlackUs && e.end_us() <= step.end_us() + kClockSlackUs;
}

TEST(GpuTrace, BenchTracesKernelsInsideTheTracedSteps) {
  const std::string dir = test::temp_dir("kiln-gpu-trace");
  const std::string path = dir + "/trace.json";
  std::string out;
  const std::string command =
      test::kiln_binary() + " bench " + test::source_dir() +
      "/configs/bench-124m.toml --set model.layers=2 --set model.hidden=256 --set model.heads=4 --set model.kv_heads=4"
      " --set model.head_dim=64 --set model.ffn_hidden=512 --set model.vocab_size=4096 --set model.max_seq_len=256"
      " --set train.micro_batch_tokens=2048 --set train.loss_chunk_tokens=2048 --set train.device=cuda"
      " --steps 1 --warmup 0 --trace " + path + " 2>&1";
  ASSERT_EQ(test::run_command(command, &out), 0) << out;
  ASSERT_EQ(out.find("the trace has no kernels"), std::string::npos) << "CUPTI did not start: " << out;
  const nlohmann::json j = nlohmann::json::parse(test::read_file(path));
  const std::vector<ReadEvent> events = complete_events(j);
  EXPECT_EQ(test::partial_overlap(events), "");
  const ReadEvent op_by_op = event_named(events, "step (op by op)"), graphed = event_named(events, "step (CUDA graph)");
  EXPECT_GE(graphed.start_us, op_by_op.end_us());

  size_t kernels = 0, in_graphed = 0, ops = 0;
  for (const ReadEvent& e : events) {
    if (e.category == "op") {
      ++ops;
      EXPECT_TRUE(within_step(e, op_by_op)) << e.name << " at " << e.start_us << " outside the op-by-op step";
    }
    if (e.category != "kernel") continue;
    ++kernels;
    EXPECT_EQ(e.process.rfind("GPU ", 0), 0u) << e.process;
    EXPECT_EQ(e.track.rfind("stream ", 0), 0u) << e.track;
    EXPECT_TRUE(e.args.contains("grid") && e.args.contains("block") && e.args.contains("registers_per_thread"));
    EXPECT_TRUE(within_step(e, op_by_op) || within_step(e, graphed))
        << e.name << " [" << e.start_us << ", " << e.end_us() << "] in neither traced step";
    in_graphed += within_step(e, graphed);
  }
  EXPECT_GT(kernels, 20u) << "the kernels track is (nearly) empty";
  EXPECT_GT(ops, 20u);
  EXPECT_GT(in_graphed, 10u) << "the replayed graphs' kernels are missing";
  EXPECT_GT(j.at("otherData").at("graph_launches").get<int64_t>(), 0);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kiln

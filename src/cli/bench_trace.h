// `kiln bench CONFIG --trace FILE.json`: after the timed steps, a Chrome/Perfetto trace
// (core/trace.h) of where one training step's time goes, in up to two sections:
//   "step (op by op)"   the step with every op front end timed (core/op_profiler.h): its
//                       phases (core/phase_scope.h) on "host phases", its ops on "ops"
//                       (GPU time from their CUDA events; wall clock on the CPU) and, on
//                       the GPU, its kernels, copies and memsets on one track per stream
//                       (core/kernel_trace.h);
//   "step (CUDA graph)" on the GPU with CUDA graphs, one step replaying the captured
//                       graphs: kernels only (a replay runs no host code), the graphs'
//                       real timeline without the launch gaps of the first.
#pragma once

#include "core/dtype.h"
#include "core/exec_context.h"

#include <functional>
#include <string>

namespace kiln::cli {

struct BenchTraceRun {
  std::function<void()> step;  // one training step, finished (synchronized) when it returns
  Device device = Device::cpu;
  bool cuda_graphs = false;                  // the step replays captured graphs when not profiled
  std::function<int64_t()> graph_launches;   // graph launches so far (with cuda_graphs)
  ExecContext exec;                          // the step's stream: its track is marked as kiln's
};

// Runs the traced steps, writes `path` and prints one line with the path and the event
// counts. Throws Error naming `path` if it cannot be written.
void write_bench_trace(const std::string& path, const BenchTraceRun& run);

}  // namespace kiln::cli

#include "cli/bench_trace.h"

#include "core/error.h"
#include "core/op_profiler.h"
#include "core/phase_scope.h"
#include "core/trace.h"

#if KILN_WITH_CUDA
#include "core/kernel_trace.h"
#endif

#include <fmt/format.h>

#include <algorithm>
#include <memory>
#include <utility>
#include <vector>

namespace kiln::cli {

namespace {

constexpr const char* kOpByOp = "step (op by op)";
constexpr const char* kGraphed = "step (CUDA graph)";

// Phase scopes add to `trace` while this lives, however the steps end.
struct ActiveTrace {
  explicit ActiveTrace(TraceRecorder& trace) { set_active_trace(&trace); }
  ~ActiveTrace() { set_active_trace(nullptr); }
};

// Every op front end records its scope (and is an NVTX range) while this lives.
struct OpProfiling {
  OpProfiling() {
    OpProfiler::set_enabled(true);
    OpProfiler::reset();
  }
  ~OpProfiling() {
    OpProfiler::set_enabled(false);
    OpProfiler::reset();
  }
};

// The op scopes on the "ops" track. A scope inside another (an op front end calling one)
// is held within it: GPU scopes come from CUDA events of half-microsecond resolution,
// which could put a nested end just past its parent's, and a viewer drops or misdraws
// slices that overlap on one track.
void add_ops(TraceRecorder& trace, const std::vector<OpInterval>& scopes) {
  std::vector<std::pair<double, double>> open;  // [start, end] of the scopes enclosing the next, by depth
  for (const OpInterval& s : scopes) {
    double start = trace.to_us(s.start), end = start + 1e3 * s.milliseconds;
    open.resize(std::min(open.size(), static_cast<size_t>(s.depth)));
    if (!open.empty()) {
      const auto [outer_start, outer_end] = open.back();
      start = std::clamp(start, outer_start, outer_end);
      end = std::clamp(end, start, outer_end);
    }
    open.emplace_back(start, end);
    trace.add({s.op, "op", "kiln", "ops", start, end - start, nullptr});
  }
}

// The events of `category` that start within the phase named `phase` ("" if none ran).
size_t count_within(const TraceRecorder& trace, const char* phase, const std::string& category) {
  const auto& events = trace.events();
  const auto range = std::find_if(events.begin(), events.end(), [&](const TraceEvent& e) { return e.name == phase; });
  if (range == events.end()) return 0;
  return static_cast<size_t>(std::count_if(events.begin(), events.end(), [&](const TraceEvent& e) {
    return e.category == category && e.start_us >= range->start_us &&
           e.start_us <= range->start_us + range->duration_us;
  }));
}

}  // namespace

void write_bench_trace(const std::string& path, const BenchTraceRun& run) {
  TraceRecorder trace;
  const bool gpu = run.device == Device::cuda;
  trace.set_metadata("ops", gpu ? "GPU time from CUDA events around each op front end" : "host wall clock");
  std::string no_kernels;  // why the trace has no kernel tracks
#if KILN_WITH_CUDA
  std::unique_ptr<cuda::KernelTrace> kernels;
  if (gpu) {
    try {
      kernels = std::make_unique<cuda::KernelTrace>(trace);
    } catch (const Error& e) {
      no_kernels = e.what();
      warn("bench", fmt::format("--trace: the trace has no kernels: {}", no_kernels));
    }
  } else {
    no_kernels = "the step ran on the CPU";
  }
#else
  no_kernels = "a CPU build, without CUPTI";
#endif

  int64_t graph_launches = 0;
  {
    ActiveTrace active(trace);
    {
      OpProfiling profiling;
      {
        KILN_PHASE(kOpByOp);
        run.step();
      }
      add_ops(trace, OpProfiler::scopes());
    }
    if (gpu && run.cuda_graphs) {
      const int64_t before = run.graph_launches();
      {
        KILN_PHASE(kGraphed);
        run.step();
      }
      graph_launches = run.graph_launches() - before;
    }
  }
#if KILN_WITH_CUDA
  if (kernels) {
    kernels->finish(trace, run.exec);
    if (kernels->dropped() > 0) {
      trace.set_metadata("dropped_gpu_records", kernels->dropped());
      warn("bench", fmt::format("--trace: CUPTI dropped {} GPU records (its buffers were full)", kernels->dropped()));
    }
  }
#endif
  trace.set_metadata("kernels", no_kernels.empty() ? "CUPTI activity records, one track per CUDA stream"
                                                   : "none: " + no_kernels);
  if (gpu && run.cuda_graphs) {
    trace.set_metadata("graph_launches", graph_launches);
    if (graph_launches == 0)
      warn("bench", fmt::format("--trace: \"{}\" launched no graph (none captured): it ran op by op", kGraphed));
  }
  trace.write(path);

  const size_t copies = trace.count("memcpy") + trace.count("memset");
  std::string gpu_side = no_kernels.empty()
                             ? fmt::format("{} kernels and {} copies/memsets", trace.count("kernel"), copies)
                             : fmt::format("no kernels: {}", no_kernels);
  if (no_kernels.empty() && gpu && run.cuda_graphs)
    gpu_side += fmt::format(", {} kernels in \"{}\"", count_within(trace, kGraphed, "kernel"), kGraphed);
  fmt::print("  trace: {}: {} phases, {} ops, {}; open it in ui.perfetto.dev\n", path, trace.count("phase"),
             trace.count("op"), gpu_side);
}

}  // namespace kiln::cli

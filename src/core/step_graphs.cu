#include "core/step_graphs.h"

#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "core/op_profiler.h"

#include <atomic>
#include <cstdio>

namespace kiln::cuda {

namespace {
std::atomic<uint64_t> g_generation{0};
}  // namespace

uint64_t capture_generation() { return g_generation.load(); }
void bump_capture_generation() { g_generation.fetch_add(1); }

StepGraphs::~StepGraphs() { clear(); }

void StepGraphs::clear() {
  for (auto& [key, exec] : graphs_) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec));
  graphs_.clear();
}

void StepGraphs::run(int64_t key, const std::function<void()>& step) {
  if (OpProfiler::enabled()) {  // profiled steps run op by op (their events are on the legacy stream)
    step();
    return;
  }
  if (generation_ != capture_generation()) {  // a buffer the graphs point into moved
    clear();
    generation_ = capture_generation();
  }
  if (auto it = graphs_.find(key); it != graphs_.end()) {
    check(cudaGraphLaunch(static_cast<cudaGraphExec_t>(it->second), stream(exec_)), owner_, "cudaGraphLaunch");
    ++launches_;
    return;
  }
  step();
  // The uncaptured step may have moved a buffer (a workspace grown for its new shape):
  // graphs captured before that must not be launched again; the one captured next sees
  // the buffer as it is now.
  if (generation_ != capture_generation()) {
    clear();
    generation_ = capture_generation();
  }
  if (failed_.count(key)) return;
  try {
    capture(key, step);
  } catch (const Error& e) {
    // The step ran (above); only its graph is missing. Later steps of this key run
    // uncaptured, slower but correct; say so once rather than fail working code.
    failed_.insert(key);
    std::fprintf(stderr, "kiln: warning: %s; %s steps of key %lld run uncaptured\n", e.what(), owner_,
                 static_cast<long long>(key));
  }
  // Nothing may move while capturing (growth is refused then); should it anyway, no graph
  // of this set is trusted.
  if (generation_ != capture_generation()) {
    clear();
    generation_ = capture_generation();
  }
}

void StepGraphs::capture(int64_t key, const std::function<void()>& step) {
  const cudaStream_t s = stream(exec_);
  // Thread-local mode: a call in this thread that could synchronize or allocate while the
  // stream captures fails (and fails the capture) instead of silently escaping the graph;
  // other threads' unrelated CUDA work is not affected.
  check(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), owner_, "cudaStreamBeginCapture");
  cudaGraph_t graph = nullptr;
  try {
    step();
  } catch (...) {
    cudaStreamEndCapture(s, &graph);
    if (graph) cudaGraphDestroy(graph);
    cudaGetLastError();  // the capture's error is the one rethrown
    throw;
  }
  check(cudaStreamEndCapture(s, &graph), owner_, "cudaStreamEndCapture (the step did something a graph cannot hold)");
  cudaGraphExec_t exec = nullptr;
  const cudaError_t status = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  check(status, owner_, "cudaGraphInstantiate");
  graphs_.emplace(key, exec);
}

}  // namespace kiln::cuda

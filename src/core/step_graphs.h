// CUDA graphs of a repeated unit of GPU work (a decode step, a training micro-batch, an
// optimizer update), one per key, shared by inference and training. No CUDA headers here,
// so host code includes it freely; it is defined in step_graphs.cu (CUDA builds only:
// CPU builds never construct one).
#pragma once

#include "core/exec_context.h"

#include <cstdint>
#include <functional>
#include <map>
#include <set>

namespace kiln::cuda {

// A captured graph holds raw device pointers. Code that reallocates a buffer which captured
// work may point into (a workspace that grows, a rebuilt device table) bumps this count;
// StepGraphs drops every graph captured under an older count and captures again.
uint64_t capture_generation();
void bump_capture_generation();

// Executable graphs of a step, one per key.
class StepGraphs {
 public:
  // Captures and launches on the stream `exec` names (held by value: a context is its stream).
  StepGraphs(const char* owner, const ExecContext& exec) : owner_(owner), exec_(exec) {}
  ~StepGraphs();
  StepGraphs(const StepGraphs&) = delete;
  StepGraphs& operator=(const StepGraphs&) = delete;

  // The first call for `key` runs step() as it is: that is the warm-up after which every
  // cuBLASLt plan, cuDNN graph, handle and workspace the step uses exists. Then it captures
  // step() on the context's stream (capture records, it does not run again) and
  // instantiates the graph; later calls for `key` launch that graph. step() must only
  // enqueue work on that stream, identical for a key (shapes and pointers fixed, varying
  // data and scalars in device memory): no synchronization, allocation or legacy-stream
  // copy. While the op profiler is on, steps run uncaptured (its events go to the legacy
  // stream). A capture that fails is reported on stderr once; that key's steps then run
  // uncaptured.
  void run(int64_t key, const std::function<void()>& step);
  bool captured(int64_t key) const { return graphs_.count(key) > 0; }
  size_t size() const { return graphs_.size(); }
  // Graph launches so far (steps that ran as a captured graph).
  int64_t launches() const { return launches_; }

 private:
  void capture(int64_t key, const std::function<void()>& step);
  void clear();

  const char* owner_;                // names this user in errors and warnings
  ExecContext exec_;                 // where the steps are captured and launched
  std::map<int64_t, void*> graphs_;  // cudaGraphExec_t by key
  std::set<int64_t> failed_;         // keys whose capture failed
  uint64_t generation_ = 0;          // capture_generation() the graphs were captured under
  int64_t launches_ = 0;
};

}  // namespace kiln::cuda

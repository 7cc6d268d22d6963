// A named phase of a training step, KILN_PHASE("forward"): an NVTX range on CUDA builds
// (so `nsys profile kiln train ...` shows the step's phases), and while a trace records
// (core/trace.h) an event on its "host phases" track. Phases time the host: on the GPU
// they span the launches, and the GPU's own time is on the trace's ops and stream tracks.
// Without a trace a phase costs an NVTX push and pop and one branch.
#pragma once

namespace kiln {

class PhaseScope {
 public:
  explicit PhaseScope(const char* name);
  ~PhaseScope();
  PhaseScope(const PhaseScope&) = delete;
  PhaseScope& operator=(const PhaseScope&) = delete;

 private:
  const char* name_;
  double start_us_ = -1;  // on the active trace's clock; < 0: no trace was recording
};

}  // namespace kiln

#define KILN_PHASE_JOIN2(a, b) a##b
#define KILN_PHASE_JOIN(a, b) KILN_PHASE_JOIN2(a, b)
#define KILN_PHASE(name) ::kiln::PhaseScope KILN_PHASE_JOIN(kiln_phase_, __LINE__)(name)

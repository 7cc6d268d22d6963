// The GPU's own timeline of a stretch of work: every kernel, memcpy and memset it ran,
// from CUPTI's activity API, as trace events (core/trace.h) on one track per CUDA stream
// of the process "GPU N". Kernels carry their demangled name, grid and block, registers
// per thread and shared memory; copies their kind and bytes.
//
// CUPTI's timestamps (ns, its own clock) are placed on the trace's clock by reading both
// clocks together when recording starts.
//
// No CUDA headers here, so host code includes it freely; defined in kernel_trace.cu (CUDA
// builds only: CPU builds never construct one). One at a time per process.
#pragma once

#include "core/exec_context.h"
#include "core/trace.h"

#include <cstddef>
#include <cstdint>

namespace kiln::cuda {

class KernelTrace {
 public:
  // Starts recording. Throws Error ("[cupti] ...": no permission to trace, a driver too
  // old for this CUPTI) if CUPTI cannot; nothing is left enabled then.
  explicit KernelTrace(const TraceRecorder& trace);
  // Stops recording if finish() did not.
  ~KernelTrace();
  KernelTrace(const KernelTrace&) = delete;
  KernelTrace& operator=(const KernelTrace&) = delete;

  // Waits for the device, stops recording and adds everything recorded to `trace` (the
  // recorder given to the constructor), the track of `exec`'s stream named as kiln's.
  // Returns the number of events added.
  size_t finish(TraceRecorder& trace, const ExecContext& exec);
  // Records CUPTI dropped for want of buffer space (0 normally; named in the trace).
  uint64_t dropped() const { return dropped_; }

 private:
  void stop();

  double origin_us_ = 0;       // the trace's clock when CUPTI's read origin_ns_
  uint64_t origin_ns_ = 0;
  bool recording_ = false;
  uint64_t dropped_ = 0;
};

}  // namespace kiln::cuda

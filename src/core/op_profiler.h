// Per-op timing for `kiln bench`: when enabled, every op front end records its time (CUDA
// events on the GPU, wall clock on the CPU) under the op's name; collect() sums them, and
// scopes() lists them one by one for a trace (core/trace.h). Enabled, each scope is also an
// NVTX range, so nsys shows the ops under the step's phases. Disabled (the default), a scope
// costs one branch.
#pragma once

#include "core/dtype.h"

#include <chrono>
#include <string>
#include <vector>

namespace kiln {

struct OpTime {
  std::string op;
  double milliseconds = 0;
  int64_t calls = 0;
};

// One recorded scope on the host's steady clock. A GPU scope's CUDA events are placed on
// that clock through a reference event recorded while the device was idle (the first GPU
// scope after a reset() waits for the device to record it), so its start is when the GPU
// ran it, not when the host launched it.
struct OpInterval {
  const char* op = nullptr;
  std::chrono::steady_clock::time_point start;
  double milliseconds = 0;
  int depth = 0;        // scopes open around it (an op front end that calls another)
  bool device = false;  // timed by CUDA events
};

class OpProfiler {
 public:
  static void set_enabled(bool enabled);
  static bool enabled() { return enabled_; }
  // Waits for the device, adds up every recorded scope since the last collect() into the
  // running totals, and returns the totals, largest first.
  static std::vector<OpTime> collect();
  // Waits for the device and returns the scopes recorded since the last collect() or
  // reset(), in the order they began; they stay for collect().
  static std::vector<OpInterval> scopes();
  static void reset();

 private:
  friend class OpScope;
  static bool enabled_;
};

class OpScope {
 public:
  OpScope(const char* op, Device device) {
    if (OpProfiler::enabled()) begin(op, device);
  }
  ~OpScope() {
    if (slot_ >= 0) end();
  }
  OpScope(const OpScope&) = delete;
  OpScope& operator=(const OpScope&) = delete;

 private:
  void begin(const char* op, Device device);
  void end();
  int64_t slot_ = -1;
};

}  // namespace kiln

#define KILN_OP_SCOPE(op, tensor) ::kiln::OpScope kiln_op_scope_((op), (tensor).device())

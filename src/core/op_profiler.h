// Per-op timing for `kiln bench`: when enabled, every op front end records its time (CUDA
// events on the GPU, wall clock on the CPU) under the op's name; collect() sums them.
// Disabled (the default), a scope costs one branch.
#pragma once

#include "core/dtype.h"

#include <string>
#include <vector>

namespace kiln {

struct OpTime {
  std::string op;
  double milliseconds = 0;
  int64_t calls = 0;
};

class OpProfiler {
 public:
  static void set_enabled(bool enabled);
  static bool enabled() { return enabled_; }
  // Waits for the device, adds up every recorded scope since the last collect() into the
  // running totals, and returns the totals, largest first.
  static std::vector<OpTime> collect();
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

#include "core/phase_scope.h"

#include "core/nvtx_range.h"
#include "core/trace.h"

namespace kiln {

PhaseScope::PhaseScope(const char* name) : name_(name) {
  nvtx_push(name);
  if (const TraceRecorder* trace = active_trace()) start_us_ = trace->now_us();
}

PhaseScope::~PhaseScope() {
  nvtx_pop();
  // A trace that started or stopped inside the phase gets no half of it.
  TraceRecorder* trace = active_trace();
  if (!trace || start_us_ < 0) return;
  const double end_us = trace->now_us();
  trace->add({name_, "phase", "kiln", "host phases", start_us_, end_us - start_us_, nullptr});
}

}  // namespace kiln

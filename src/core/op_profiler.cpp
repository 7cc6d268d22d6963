#include "core/op_profiler.h"

#include "core/error.h"
#include "core/nvtx_range.h"

#include <algorithm>
#include <chrono>
#include <map>

#if KILN_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace kiln {

bool OpProfiler::enabled_ = false;

namespace {

// One timed scope: host clock readings, or a pair of CUDA events (reused across steps).
struct Slot {
  const char* op = nullptr;
  Device device = Device::cpu;
  int depth = 0;
  std::chrono::steady_clock::time_point host_start, host_end;
#if KILN_WITH_CUDA
  cudaEvent_t start = nullptr, stop = nullptr;
#endif
};

std::vector<Slot>& slots() {
  static std::vector<Slot> s;
  return s;
}
size_t used = 0;
int open_scopes = 0;

#if KILN_WITH_CUDA
// The reference that places GPU scopes on the host clock: an event recorded on an idle
// device, and the host time it completed at (the middle of the record and its wait, a
// few microseconds apart).
struct Reference {
  bool recorded = false;
  cudaEvent_t event = nullptr;
  std::chrono::steady_clock::time_point host;
};
Reference reference;

void record_reference() {
  cudaDeviceSynchronize();
  if (!reference.event) cudaEventCreate(&reference.event);
  const auto before = std::chrono::steady_clock::now();
  cudaEventRecord(reference.event, nullptr);
  cudaEventSynchronize(reference.event);
  const auto after = std::chrono::steady_clock::now();
  reference.host = before + (after - before) / 2;
  reference.recorded = true;
}
#endif
std::map<std::string, OpTime>& totals() {
  static std::map<std::string, OpTime> t;
  return t;
}

}  // namespace

void OpProfiler::set_enabled(bool enabled) { enabled_ = enabled; }

void OpScope::begin(const char* op, Device device) {
  auto& all = slots();
  if (used == all.size()) all.emplace_back();
  Slot& s = all[used];
  s.op = op;
  s.device = device;
  s.depth = open_scopes++;
  nvtx_push(op);
#if KILN_WITH_CUDA
  if (device == Device::cuda) {
    if (!reference.recorded) record_reference();
    if (!s.start) cudaEventCreate(&s.start), cudaEventCreate(&s.stop);
    cudaEventRecord(s.start, nullptr);
  }
#endif
  s.host_start = std::chrono::steady_clock::now();
  slot_ = static_cast<int64_t>(used++);
}

void OpScope::end() {
  Slot& s = slots()[static_cast<size_t>(slot_)];
#if KILN_WITH_CUDA
  if (s.device == Device::cuda) cudaEventRecord(s.stop, nullptr);
#endif
  s.host_end = std::chrono::steady_clock::now();
  nvtx_pop();
  --open_scopes;
}

std::vector<OpTime> OpProfiler::collect() {
#if KILN_WITH_CUDA
  cudaDeviceSynchronize();
#endif
  for (size_t i = 0; i < used; ++i) {
    Slot& s = slots()[i];
    double ms = std::chrono::duration<double, std::milli>(s.host_end - s.host_start).count();
#if KILN_WITH_CUDA
    float device_ms = 0;
    if (s.device == Device::cuda && cudaEventElapsedTime(&device_ms, s.start, s.stop) == cudaSuccess) ms = device_ms;
#endif
    OpTime& t = totals()[s.op];
    t.op = s.op;
    t.milliseconds += ms;
    ++t.calls;
  }
  used = 0;
  std::vector<OpTime> out;
  for (const auto& [name, t] : totals()) out.push_back(t);
  std::sort(out.begin(), out.end(), [](const OpTime& a, const OpTime& b) { return a.milliseconds > b.milliseconds; });
  return out;
}

std::vector<OpInterval> OpProfiler::scopes() {
#if KILN_WITH_CUDA
  cudaDeviceSynchronize();
#endif
  std::vector<OpInterval> out;
  for (size_t i = 0; i < used; ++i) {
    const Slot& s = slots()[i];
    OpInterval& interval = out.emplace_back();
    interval.op = s.op;
    interval.depth = s.depth;
    interval.start = s.host_start;
    interval.milliseconds = std::chrono::duration<double, std::milli>(s.host_end - s.host_start).count();
#if KILN_WITH_CUDA
    float since_reference = 0, ms = 0;
    if (s.device == Device::cuda && reference.recorded &&
        cudaEventElapsedTime(&since_reference, reference.event, s.start) == cudaSuccess &&
        cudaEventElapsedTime(&ms, s.start, s.stop) == cudaSuccess) {
      interval.start = reference.host + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                            std::chrono::duration<double, std::milli>(since_reference));
      interval.milliseconds = ms;
      interval.device = true;
    }
#endif
  }
  return out;
}

void OpProfiler::reset() {
  used = 0;
  totals().clear();
#if KILN_WITH_CUDA
  reference.recorded = false;  // the next GPU scope records a fresh one
#endif
}

}  // namespace kiln

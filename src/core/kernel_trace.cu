#include "core/kernel_trace.h"

#include "core/cuda_context.h"
#include "core/error.h"

#include <cuda_runtime.h>
#include <cupti.h>
#include <cxxabi.h>
#include <fmt/format.h>

#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace kiln::cuda {

namespace {

// The records CUPTI hands back are the layouts of the headers this is built with; the
// library is the toolkit's own (scripts/gpu_stage.sh bundles it), so they agree.
using KernelRecord = CUpti_ActivityKernel10;
using MemcpyRecord = CUpti_ActivityMemcpy6;
using MemsetRecord = CUpti_ActivityMemset4;

constexpr CUpti_ActivityKind kKinds[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY,
                                         CUPTI_ACTIVITY_KIND_MEMSET};
constexpr size_t kBufferBytes = size_t{8} << 20;  // CUPTI fills, then hands back, buffers of this size

void check_cupti(CUptiResult result, const char* call) {
  if (result == CUPTI_SUCCESS) return;
  const char* text = nullptr;
  cuptiGetResultString(result, &text);
  fail("cupti", "{}: {}", call, text ? text : fmt::format("error {}", static_cast<int>(result)));
}

std::string demangle(const char* name) {
  if (!name) return "(unnamed kernel)";
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> plain(abi::__cxa_demangle(name, nullptr, nullptr, &status), std::free);
  return status == 0 && plain ? std::string(plain.get()) : std::string(name);
}

const char* copy_kind(uint8_t kind) {
  switch (kind) {
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOD: return "HtoD";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOH: return "DtoH";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOD: return "DtoD";
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOH: return "HtoH";
    case CUPTI_ACTIVITY_MEMCPY_KIND_PTOP: return "PtoP";
    default: return "other";
  }
}

// One record, copied out of CUPTI's buffer (whose names it may reuse) as it arrives;
// times still on CUPTI's clock.
struct Activity {
  TraceEvent event;  // start_us and duration_us unset
  uint64_t start_ns = 0, end_ns = 0;
  uint32_t device = 0, stream = 0;
};

// What CUPTI's buffer callbacks fill (they may run on a thread of CUPTI's own).
struct Collected {
  std::mutex mutex;
  std::vector<Activity> activities;
  uint64_t dropped = 0;
};
Collected& collected() {
  static Collected c;
  return c;
}

Activity from_record(const CUpti_Activity* record) {
  Activity a;
  TraceEvent& e = a.event;
  if (record->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) {
    const auto* k = reinterpret_cast<const KernelRecord*>(record);
    e.name = demangle(k->name);
    e.category = "kernel";
    e.args = {{"grid", {k->gridX, k->gridY, k->gridZ}},
              {"block", {k->blockX, k->blockY, k->blockZ}},
              {"registers_per_thread", k->registersPerThread},
              {"static_shared_bytes", k->staticSharedMemory},
              {"dynamic_shared_bytes", k->dynamicSharedMemory}};
    if (k->graphId) e.args["graph"] = k->graphId;
    a.start_ns = k->start, a.end_ns = k->end, a.device = k->deviceId, a.stream = k->streamId;
  } else if (record->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
    const auto* m = reinterpret_cast<const MemcpyRecord*>(record);
    e.name = fmt::format("memcpy {}", copy_kind(m->copyKind));
    e.category = "memcpy";
    e.args = {{"bytes", m->bytes}};
    if (m->graphId) e.args["graph"] = m->graphId;
    a.start_ns = m->start, a.end_ns = m->end, a.device = m->deviceId, a.stream = m->streamId;
  } else {
    const auto* m = reinterpret_cast<const MemsetRecord*>(record);
    e.name = "memset";
    e.category = "memset";
    e.args = {{"bytes", m->bytes}, {"value", m->value}};
    if (m->graphId) e.args["graph"] = m->graphId;
    a.start_ns = m->start, a.end_ns = m->end, a.device = m->deviceId, a.stream = m->streamId;
  }
  return a;
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));  // CUPTI needs 8-byte alignment
  *size = *buffer ? kBufferBytes : 0;
  *max_records = 0;  // as many as fit
}

void CUPTIAPI buffer_completed(CUcontext context, uint32_t stream, uint8_t* buffer, size_t, size_t valid) {
  std::vector<Activity> parsed;
  CUpti_Activity* record = nullptr;
  while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    if (record->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || record->kind == CUPTI_ACTIVITY_KIND_MEMCPY ||
        record->kind == CUPTI_ACTIVITY_KIND_MEMSET)
      parsed.push_back(from_record(record));
  }
  size_t dropped = 0;
  cuptiActivityGetNumDroppedRecords(context, stream, &dropped);
  std::free(buffer);
  Collected& c = collected();
  std::lock_guard<std::mutex> lock(c.mutex);
  c.activities.insert(c.activities.end(), std::make_move_iterator(parsed.begin()),
                      std::make_move_iterator(parsed.end()));
  c.dropped += dropped;
}

}  // namespace

KernelTrace::KernelTrace(const TraceRecorder& trace) {
  // Once per process: CUPTI keeps the callbacks until it is finalized.
  static const CUptiResult registered = cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed);
  check_cupti(registered, "cuptiActivityRegisterCallbacks");
  {
    Collected& c = collected();
    std::lock_guard<std::mutex> lock(c.mutex);
    c.activities.clear();
    c.dropped = 0;
  }
  // Work already queued is not this trace's: let it finish before recording starts.
  cudaDeviceSynchronize();
  for (size_t i = 0; i < std::size(kKinds); ++i) {
    const CUptiResult result = cuptiActivityEnable(kKinds[i]);
    if (result != CUPTI_SUCCESS) {
      for (size_t j = 0; j < i; ++j) cuptiActivityDisable(kKinds[j]);
      check_cupti(result, "cuptiActivityEnable");
    }
  }
  recording_ = true;
  // Both clocks read together: the host's before and after CUPTI's, taken at the middle.
  const double before = trace.now_us();
  const CUptiResult stamped = cuptiGetTimestamp(&origin_ns_);
  origin_us_ = (before + trace.now_us()) / 2;
  if (stamped != CUPTI_SUCCESS) {
    stop();
    check_cupti(stamped, "cuptiGetTimestamp");
  }
}

KernelTrace::~KernelTrace() {
  if (recording_) stop();
}

void KernelTrace::stop() {
  cudaDeviceSynchronize();
  for (const CUpti_ActivityKind kind : kKinds) cuptiActivityDisable(kind);
  cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);  // hands back every buffer, full or not
  recording_ = false;
}

size_t KernelTrace::finish(TraceRecorder& trace, const ExecContext& exec) {
  if (recording_) stop();
  uint32_t kiln_stream = 0;
  const bool known = cuptiGetStreamIdEx(nullptr, stream(exec), 0, &kiln_stream) == CUPTI_SUCCESS;
  std::vector<Activity> activities;
  {
    Collected& c = collected();
    std::lock_guard<std::mutex> lock(c.mutex);
    activities.swap(c.activities);
    dropped_ = c.dropped;
  }
  for (Activity& a : activities) {
    TraceEvent& e = a.event;
    e.process = fmt::format("GPU {}", a.device);
    e.track = fmt::format("stream {}{}", a.stream, known && a.stream == kiln_stream ? " (kiln)" : "");
    // The difference in integers (a double cannot hold nanoseconds since boot exactly), signed:
    // a record may start before the origin.
    const auto since_origin_ns = static_cast<int64_t>(a.start_ns - origin_ns_);
    e.start_us = origin_us_ + static_cast<double>(since_origin_ns) / 1e3;
    e.duration_us = a.end_ns > a.start_ns ? static_cast<double>(a.end_ns - a.start_ns) / 1e3 : 0;
    trace.add(std::move(e));
  }
  return activities.size();
}

}  // namespace kiln::cuda

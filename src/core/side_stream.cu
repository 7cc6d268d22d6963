#include "core/side_stream.h"

#include "core/cuda_check.h"
#include "core/cuda_context.h"

namespace kiln::cuda {

namespace {
cudaEvent_t as_event(void* event) { return static_cast<cudaEvent_t>(event); }

void* make_event() {
  cudaEvent_t event = nullptr;
  // No timing: an event only orders streams (and timing events cost a little per record).
  check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "side stream", "cudaEventCreate");
  return event;
}
}  // namespace

SideStream::SideStream(const ExecContext& main) : main_(main) {
  cudaStream_t side = nullptr;
  // Non-blocking: the legacy default stream never serializes it with the main stream.
  check(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking), "side stream", "cudaStreamCreate");
  side_.stream = side;
  forked_ = make_event();
  joined_ = make_event();
}

SideStream::~SideStream() {
  cudaEventDestroy(as_event(forked_));
  cudaEventDestroy(as_event(joined_));
  cudaStreamDestroy(as_stream(side_.stream));
}

void SideStream::fork() {
  check(cudaEventRecord(as_event(forked_), stream(main_)), "side stream", "cudaEventRecord (fork)");
  check(cudaStreamWaitEvent(as_stream(side_.stream), as_event(forked_), 0), "side stream", "cudaStreamWaitEvent (fork)");
}

void SideStream::join() {
  check(cudaEventRecord(as_event(joined_), as_stream(side_.stream)), "side stream", "cudaEventRecord (join)");
  check(cudaStreamWaitEvent(stream(main_), as_event(joined_), 0), "side stream", "cudaStreamWaitEvent (join)");
}

}  // namespace kiln::cuda

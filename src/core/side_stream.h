// A second CUDA stream beside a context's: work forked onto it runs concurrently with the
// main stream's later work, and joins back before the main stream goes on past the join.
// Data parallelism reduces gradient buckets on one while backward runs (train/
// gradient_buckets.h). Fork and join are event record and wait, which a CUDA graph
// capture turns into its edges, so a captured micro-batch replays the overlap; a capture
// must join every fork before it ends. No CUDA headers here; defined in side_stream.cu
// (CUDA builds only: CPU builds never construct one).
#pragma once

#include "core/exec_context.h"

namespace kiln::cuda {

class SideStream {
 public:
  // Beside `main` (held by value: a context is its stream). Creates a non-blocking stream
  // and its two events; never inside a capture.
  explicit SideStream(const ExecContext& main);
  ~SideStream();
  SideStream(const SideStream&) = delete;
  SideStream& operator=(const SideStream&) = delete;

  // The side stream's context: ops and collectives enqueued there.
  const ExecContext& exec() const { return side_; }
  // The side stream waits for everything enqueued on the main stream so far.
  void fork();
  // The main stream waits for everything enqueued on the side stream so far.
  void join();

 private:
  ExecContext main_, side_;
  void* forked_ = nullptr;  // cudaEvent_t: recorded on main, waited on by side
  void* joined_ = nullptr;  // cudaEvent_t: recorded on side, waited on by main
};

}  // namespace kiln::cuda

// Where an op runs: the CUDA stream that its kernels and library calls go to. Ops take
// one as their first argument, as flashinfer's kernels take a stream, so that the caller
// decides where work runs: the step program (issue 39) puts gradient reduction on a
// stream of its own, a pipeline stage its model on its own device.
//
// Step (a) of that redesign: every context is still the process-wide stream of
// core/cuda_context.h (a null `stream`); ops that launch only there refuse any other
// (ops::expect_process_stream) until their kernels take the stream from the context.
#pragma once

namespace kiln {

struct ExecContext {
  // A cudaStream_t, held as void* so host-only translation units can pass one along.
  // Null: the process-wide stream.
  void* stream = nullptr;
};

// The context of callers that run on the process-wide stream: tests, tools, and the
// model until the step program owns its streams.
inline const ExecContext& process_exec() {
  static const ExecContext context;
  return context;
}

}  // namespace kiln

// Where an op runs: the CUDA stream that its kernels and library calls go to. Ops take
// one as their first argument, as flashinfer's kernels take a stream, so that the caller
// decides where work runs: the step program (issue 39) puts gradient reduction on a
// stream of its own, a pipeline stage its model on its own device.
//
// Every op launches on its context's stream, and what a kernel family keeps between its
// launches lives in that context's scratch (core/context_scratch.h), so work on two
// streams never meets. A null `stream` names the process-wide stream of
// core/cuda_context.h (the default context of tests, tools and today's model).
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

// Process-wide CUDA handles for the kernels: the stream they run on and the cuBLAS
// handle bound to it. Created on first use (outside the step loop: the model's first
// forward happens before training starts timing). Only for CUDA translation units.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "core/exec_context.h"

namespace kiln::cuda {

cudaStream_t stream();
// The stream an execution context names (core/exec_context.h): its own, or the
// process-wide one when it names none.
inline cudaStream_t stream(const ExecContext& ctx) {
  return ctx.stream ? static_cast<cudaStream_t>(ctx.stream) : stream();
}
cublasHandle_t blas();
// A cuBLAS handle bound to the stream a context names (the one above for the process-wide
// stream; one per other stream, created on its first use, so that two streams never share
// a handle's workspace).
cublasHandle_t blas(const ExecContext& ctx);
// Streaming multiprocessors of the current device (asked once): kernels that size their
// grid to what is resident at once.
int sm_count();

// Blocks of `threads` covering n items (at most 65535 * 1024 * ... grid-stride loops do the rest).
inline unsigned blocks_for(int64_t n, int threads) {
  const int64_t b = (n + threads - 1) / threads;
  return static_cast<unsigned>(b < 1 ? 1 : (b > 65535 * 16 ? 65535 * 16 : b));
}

}  // namespace kiln::cuda

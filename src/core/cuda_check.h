// Error checks for CUDA translation units (.cu): every runtime call's status and the
// last error after each launch become kiln::Error("[op] ..."). Include only from code
// built with the CUDA backend.
#pragma once

#include "core/error.h"

#include <cuda_runtime.h>

namespace kiln::cuda {

// Throws "[where] what: cudaErrorX (message)" unless status is cudaSuccess.
inline void check(cudaError_t status, const char* where, const char* what) {
  if (status != cudaSuccess) fail(where, "{}: {} ({})", what, cudaGetErrorName(status), cudaGetErrorString(status));
}

// Call right after a kernel launch: catches bad configurations (grid, block, shared memory)
// without synchronizing. Faults inside the kernel surface at the next synchronizing call.
inline void check_launch(const char* where, const char* kernel) {
  check(cudaGetLastError(), where, kernel);
}

inline cudaStream_t as_stream(void* stream) { return static_cast<cudaStream_t>(stream); }

}  // namespace kiln::cuda

// NVTX ranges: what Nsight Systems (nsys profile) shows on a thread's timeline. NVTX v3
// is header-only (the toolkit's nvtx3/): without a tool attached a push or pop is a call
// through a null-checked pointer. Nothing on CPU builds. Include only from .cpp/.cu files.
#pragma once

#if KILN_WITH_CUDA
#include <nvtx3/nvToolsExt.h>
#endif

namespace kiln {

inline void nvtx_push(const char* name) {
#if KILN_WITH_CUDA
  nvtxRangePushA(name);
#else
  (void)name;
#endif
}

inline void nvtx_pop() {
#if KILN_WITH_CUDA
  nvtxRangePop();
#endif
}

}  // namespace kiln

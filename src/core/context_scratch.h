// Device scratch that a kernel family keeps across the launches of one op call: the
// partial sums of a deterministic two-kernel reduction, a loss summed over chunks. It was
// module-level `__device__` memory, shared by every stream, which made a second stream
// unsafe (issue 39, step c). Now each execution context (core/exec_context.h: one stream)
// has its own buffer per kind, so work on two streams never meets in scratch, while the
// ops on one stream still run one after another and may reuse it from call to call.
//
// A buffer is allocated on the kind's first use on a stream, zeroed, and kept for the life
// of the process (as the module-level memory was). The first use must not be inside a CUDA
// graph capture: the captured steps run once uncaptured first (core/step_graphs.h), so they
// allocate there; an allocation under capture fails naming the kind. Only for CUDA
// translation units.
#pragma once

#include "core/exec_context.h"

#include <cstddef>

namespace kiln::cuda {

// One kind of scratch: its name (for errors) and its size. Declared once per kernel
// family, as a namespace-scope constant; its address tells the kinds apart.
struct ScratchKind {
  const char* name;
  size_t bytes;
};

// The context's buffer of `kind` (kind.bytes bytes, zero on first use).
void* context_scratch(const ExecContext& ctx, const ScratchKind& kind);

template <typename T>
T* context_scratch_as(const ExecContext& ctx, const ScratchKind& kind) {
  return static_cast<T*>(context_scratch(ctx, kind));
}

}  // namespace kiln::cuda

// Parameter gradients summed without atomics (the same bits every run): kernels write one
// partial row per block or tile into the context's scratch, then add_partials adds the rows
// in order onto the gradient. Used by the KDA mixer's kernels and the short convolution's.
#pragma once

#include "core/exec_context.h"

#include <cstdint>

namespace kiln::cuda {

// out[e] += sum over b = 0 .. parts - 1 of partials[b * cols + e], b in order (out fp32, device).
void add_partials(const ExecContext& ctx, const float* partials, int64_t parts, int64_t cols, float* out,
                  const char* op);

}  // namespace kiln::cuda

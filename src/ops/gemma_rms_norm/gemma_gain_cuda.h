// The CUDA kernel behind ops::gemma_gain (gemma_gain_cuda.cu): gain = 1 + w in fp32, the
// one step Gemma's RMSNorm adds to the RMSNorm kernels (which serve both GPU paths: the
// gain is fp32 on each). Launches on the context's stream; the front end validates.
#pragma once

#include "core/exec_context.h"

#include <cstdint>

namespace kiln::cuda {

void gemma_gain(const ExecContext& ctx, const float* w, int64_t count, float* gain);

}  // namespace kiln::cuda

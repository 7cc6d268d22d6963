// A learnable attention sink (docs/attention-sinks.md) at the end of a decode kernel's
// online softmax: the sink logit s of the head joins the running max m and sum l of the
// scores as one more key with no value, as the CPU's softmax_combine (attention_math.h)
// takes it. The kernels accumulate the output relative to m; with the sink the output is
// acc * scale / denominator, where the max moves to max(m, s).
#pragma once

#include <cstdint>

namespace kiln::cuda {

struct SinkNormalizer {
  float scale;        // exp(m - max(m, s)): moves the accumulator to the new max
  float denominator;  // l scale + exp(s - max(m, s))
};

// sinks [q_heads] f32 on the device, or null (no sink: scale 1, denominator l, so
// acc * 1 / l rounds as acc / l did before sinks existed).
__device__ __forceinline__ SinkNormalizer sink_normalizer(float m, float l, const float* sinks, int64_t head) {
  if (sinks == nullptr) return {1.0f, l};
  const float s = sinks[head];
  const float mx = fmaxf(m, s);
  const float scale = expf(m - mx);  // m is finite: every row sees at least its own key
  return {scale, l * scale + expf(s - mx)};
}

}  // namespace kiln::cuda

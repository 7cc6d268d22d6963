// Which counts the router losses divide by, one copy for the CPU reference (routing.cpp)
// and the CUDA kernels (routing_cuda.cu), so both scopes of model.moe.balance_scope are
// one formula. The micro-batch scope: the Switch balance loss's f_i and its 1/T are the
// micro-batch's own (its choices per expert over its T tokens). The step scope: the step's
// counts, f64 [E + 1] on the probabilities' device (the choices per expert over every
// micro-batch and rank, then the routed tokens; the counting pass fills them before the
// step's first backward, train/step_program.cpp), read where the loss is formed, so a
// captured step replays for any counts. A forward outside a step (validation) finds them
// cleared (0 tokens) and takes its micro-batch's own.
#pragma once

#include "core/host_device.h"

#include <cstdint>

namespace kiln::balance_scope {

// The tokens a router loss's mean is over: the step's (*step_tokens, once counted), else
// the micro-batch's.
KILN_HOST_DEVICE inline double routed_tokens(const double* step_tokens, int64_t tokens) {
  return step_tokens != nullptr && *step_tokens > 0 ? *step_tokens : static_cast<double>(tokens);
}

struct Counts {
  const int32_t* micro = nullptr;  // i32 [E]: the micro-batch's choices per expert
  int64_t tokens = 0;              // the micro-batch's tokens
  const double* step = nullptr;    // f64 [E + 1]: the step's (null: the micro-batch scope)
  int64_t e_count = 0;
  int64_t top_k = 1;

  KILN_HOST_DEVICE bool whole_step() const { return step != nullptr && step[e_count] > 0; }
  KILN_HOST_DEVICE double routed_tokens() const {
    return balance_scope::routed_tokens(step != nullptr ? step + e_count : nullptr, tokens);
  }
  // f_e: expert e's share of the T k choices.
  KILN_HOST_DEVICE double share(int64_t e) const {
    const double c = whole_step() ? step[e] : static_cast<double>(micro[e]);
    return c / (routed_tokens() * static_cast<double>(top_k));
  }
  // Expert e's term E f_e P_e of the loss, from its probabilities summed over this
  // micro-batch's rows (P_e's share: that sum / T).
  KILN_HOST_DEVICE double term(int64_t e, double column_sum) const {
    return static_cast<double>(e_count) * share(e) * column_sum / routed_tokens();
  }
  // d(loss) / d(probs[t, e]) x grad_scale, the same for every row (f held fixed).
  KILN_HOST_DEVICE double gradient(int64_t e, double grad_scale) const {
    return grad_scale * static_cast<double>(e_count) * share(e) / routed_tokens();
  }
};

}  // namespace kiln::balance_scope

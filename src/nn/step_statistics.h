// What components collect over a step and act on between steps (an MoE layer's expert
// loads, QK-Clip's largest logits), registered with how the ranks of a data-parallel run
// combine them: every rank must act on the whole step's statistics, or the ranks'
// weights (a router's balancing bias, the clipped q/k rows) drift apart.
#pragma once

#include "core/tensor.h"

#include <cstdint>
#include <vector>

namespace kiln {

// max_unsigned: QK-Clip's logit keys (ops/attention/logit_key.h), whose order is the
// unsigned one (dist::ReduceOp::max_unsigned).
enum class StepReduction : uint8_t { sum, max_unsigned };

struct StepStatistic {
  Tensor* tensor;  // a step buffer (BuildContext::step_statistic)
  StepReduction reduction;
};

using StepStatistics = std::vector<StepStatistic>;

}  // namespace kiln

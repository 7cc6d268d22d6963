// Inverted dropout on the residual stream: y = x / (1 - p) where the mask keeps an element,
// 0 where it drops it (ops/dropout/dropout_mask.h decides). The same call is the forward
// (on a branch's output) and the backward (on the gradient that reaches it): the mask is a
// function of (key, site, index), found again rather than stored.
#pragma once

#include "core/exec_context.h"
#include "core/tensor.h"

#include <cstdint>

namespace kiln::ops {

struct DropoutSite {
  double p = 0;          // drop probability, [0, 1)
  uint32_t site = 0;     // which dropout of the model
  // The micro-batch's stream key: i32 [2] (low word, high word) on the data's device, so a
  // captured GPU step reads the key of each replay from device memory.
  Tensor key;
};

// x [rows, cols] -> y (=, may alias x); the flat index of (r, c) is r * cols + c.
void dropout_apply(const ExecContext& ctx, const Tensor& x, const DropoutSite& site, const Tensor& y);

}  // namespace kiln::ops

// The loss weights of multi-token prediction ([model.mtp]): the main head's and each depth's,
// from model.mtp.weights or the form's default. The objective of a step is
//   main x L_main + sum_k depths[k-1] x L_k
// with each L a mean over the step's target tokens.
#pragma once

#include "config/config.h"

#include <vector>

namespace kiln {

struct MtpLossWeights {
  double main = 1;
  std::vector<double> depths;  // model.mtp.depth of them; empty when MTP is off
};

// Throws naming model.mtp.weights when it is not model.mtp.depth non-negative numbers.
MtpLossWeights mtp_loss_weights(const ModelConfig& model);

}  // namespace kiln

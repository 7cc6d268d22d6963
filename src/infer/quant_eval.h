// How much a quantized copy of a model departs from the original on held-out text: the
// mean over positions of KL(p_ref || p_quant) of the next-token distributions, top-1
// agreement, and each model's cross-entropy on the actual next tokens.
#pragma once

#include "model/model.h"

#include <cstdint>
#include <vector>

namespace kiln {

struct QuantEvalResult {
  int64_t positions = 0;      // next-token distributions compared
  double mean_kl = 0;         // nats
  double max_kl = 0;
  double top1_agreement = 0;  // fraction of positions whose argmax agrees
  double ref_loss = 0;        // mean cross-entropy (nats) of the reference on the targets
  double quant_loss = 0;
};

// Each sequence (BOS first) runs alone through both models (built for at least its
// length); every position but the last is scored against the next token.
QuantEvalResult evaluate_quantization(Model& ref, Model& quant, const std::vector<std::vector<int32_t>>& sequences);

}  // namespace kiln

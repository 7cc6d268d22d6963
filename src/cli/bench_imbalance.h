// `kiln bench --imbalance R`: the sparse layers' busiest expert held at R x the mean load,
// to measure what an uneven routing costs. The sigmoid_bias router's bias (DeepSeek-V3's
// aux-loss-free balancing, which chooses on score + bias) is what steers the load: expert
// 0's bias is raised per layer, by bisection on the load the layer reports, and kept
// (model.moe.bias_rate = 0) while the bench times the steps. The weights are held too
// (optim.lr = 1e-9: a training step costs the same at any rate), or the router, learning,
// drifts from the load the bias was set for (on the CPU, 4x fell to 2x in 20 steps).
#pragma once

#include "model/model.h"

#include <functional>
#include <string>
#include <vector>

namespace kiln::cli {

struct ImbalanceResult {
  std::vector<double> load_max;  // per sparse layer: the busiest expert's load / the mean
  std::vector<double> bias;      // expert 0's bias that got it there
  int calibration_steps = 0;
};

// Runs `step` (one training step, the bench's) until every sparse layer's load_max is
// within 5% of `target`, or 24 steps; fails when the model has no sigmoid_bias layer.
ImbalanceResult hold_imbalance(Model& model, double target, const std::function<void()>& step);

// "load_max 1.98-2.03 over 15 layers (expert 0's bias 0.31-0.36, 14 calibration steps)"
std::string describe(const ImbalanceResult& r);

}  // namespace kiln::cli

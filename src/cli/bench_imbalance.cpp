#include "cli/bench_imbalance.h"

#include "core/error.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>

namespace kiln::cli {

namespace {

constexpr const char* kBiasSuffix = ".mlp.gate.e_score_correction_bias";

struct SteeredLayer {
  const Parameter* bias = nullptr;
  std::string metric;     // "moe.L.load_max"
  double low = 0, high = 1;  // bisection bracket of expert 0's bias (sigmoid scores are in (0, 1))
  double applied = 0;        // the bias the last step ran with (and the timed steps keep)
  double load = 0;
};

void set_expert0_bias(const Parameter& p, double value) {
  OwnedTensor host(p.value().dtype(), Device::cpu, p.value().shape());
  copy_tensor(p.value(), *host);
  KILN_CHECK(host->dtype() == DType::f32, "bench", "--imbalance: {} is {}, expected f32", p.name(),
             dtype_name(host->dtype()));
  host->data<float>()[0] = static_cast<float>(value);
  copy_tensor(*host, p.value());
}

}  // namespace

ImbalanceResult hold_imbalance(Model& model, double target, const std::function<void()>& step) {
  KILN_CHECK(target > 1.0, "bench", "--imbalance {}: the busiest expert's load / the mean must be > 1", target);
  std::vector<SteeredLayer> layers;
  for (const auto& p : model.parameters()) {
    const std::string& name = p->name();
    if (!name.starts_with("layers.") || !name.ends_with(kBiasSuffix)) continue;
    const std::string layer = name.substr(7, name.size() - 7 - std::string(kBiasSuffix).size());
    layers.push_back({p.get(), "moe." + layer + ".load_max"});
  }
  KILN_CHECK(!layers.empty(), "bench",
             "--imbalance needs sparse layers routed by sigmoid_bias (its bias steers the load): "
             "--set model.moe.router=sigmoid_bias");
  ImbalanceResult r;
  for (int iteration = 0; iteration < 24; ++iteration) {
    for (SteeredLayer& l : layers) set_expert0_bias(*l.bias, l.applied = 0.5 * (l.low + l.high));
    step();
    ++r.calibration_steps;
    std::map<std::string, double> metrics;
    for (const auto& [name, value] : model.component_metrics()) metrics[name] = value;
    bool all_within = true;
    for (SteeredLayer& l : layers) {
      const auto it = metrics.find(l.metric);
      KILN_CHECK(it != metrics.end(), "bench", "--imbalance: the model reports no {}", l.metric);
      l.load = it->second;
      (l.load < target ? l.low : l.high) = l.applied;
      all_within = all_within && std::fabs(l.load / target - 1) <= 0.05;
    }
    if (all_within) break;
  }
  for (const SteeredLayer& l : layers) {
    r.load_max.push_back(l.load);
    r.bias.push_back(l.applied);
  }
  return r;
}

std::string describe(const ImbalanceResult& r) {
  const auto [lmin, lmax] = std::minmax_element(r.load_max.begin(), r.load_max.end());
  const auto [bmin, bmax] = std::minmax_element(r.bias.begin(), r.bias.end());
  return fmt::format("load_max {:.2f}-{:.2f} over {} layers (expert 0's bias {:.3f}-{:.3f}, {} calibration steps)", *lmin,
                     *lmax, r.load_max.size(), *bmin, *bmax, r.calibration_steps);
}

}  // namespace kiln::cli

#include "train/pipeline_split.h"

#include "core/error.h"

#include <fmt/format.h>

#include <algorithm>
#include <functional>
#include <iterator>
#include <limits>
#include <sstream>

namespace kiln {

namespace {

constexpr double kNone = std::numeric_limits<double>::infinity();

// A stage's cost over layers [a, b) with the extras of the end stages: one function for
// every comparison, so the planner's two passes see the same sums to the bit.
struct StageCosts {
  const PipelineCosts& costs;
  std::vector<double> time_prefix, memory_prefix, activation_prefix;  // [L + 1]

  explicit StageCosts(const PipelineCosts& c) : costs(c) {
    const size_t n = c.layers.size();
    time_prefix.assign(n + 1, 0);
    memory_prefix.assign(n + 1, 0);
    activation_prefix.assign(n + 1, 0);
    for (size_t l = 0; l < n; ++l) {
      time_prefix[l + 1] = time_prefix[l] + c.layers[l].time;
      memory_prefix[l + 1] = memory_prefix[l] + c.layers[l].memory;
      activation_prefix[l + 1] = activation_prefix[l] + c.layers[l].activations;
    }
  }
  int in_flight(int64_t stage) const {
    const auto s = static_cast<size_t>(stage);
    return s < costs.stage_in_flight.size() ? std::max(costs.stage_in_flight[s], 1) : 1;
  }
  int64_t layers() const { return static_cast<int64_t>(costs.layers.size()); }
  double time(int64_t a, int64_t b) const {
    return time_prefix[b] - time_prefix[a] + (a == 0 ? costs.first_extra.time : 0) +
           (b == layers() ? costs.last_extra.time : 0);
  }
  // Stage `stage` over layers [a, b): its memory with one micro-batch's activations, plus
  // the activations of the others it keeps in flight.
  double memory(int64_t stage, int64_t a, int64_t b) const {
    return memory_prefix[b] - memory_prefix[a] + (a == 0 ? costs.first_extra.memory : 0) +
           (b == layers() ? costs.last_extra.memory : 0) +
           (in_flight(stage) - 1) * (activation_prefix[b] - activation_prefix[a]);
  }
};

// The least, over every split of the layers into `stages` stages each passing `allowed`, of
// the largest stage_value: best[k][j] covers layers [0, j) with k stages. kNone: no split.
// Both functions take (stage index, first layer, end layer).
using StageFunction = std::function<double(int64_t, int64_t, int64_t)>;
double least_bottleneck(int64_t layers, int64_t stages, const StageFunction& stage_value,
                        const std::function<bool(int64_t, int64_t, int64_t)>& allowed) {
  std::vector<std::vector<double>> best(stages + 1, std::vector<double>(layers + 1, kNone));
  best[0][0] = 0;
  for (int64_t k = 1; k <= stages; ++k)
    for (int64_t j = k; j <= layers - (stages - k); ++j)
      for (int64_t i = k - 1; i < j; ++i)
        if (best[k - 1][i] < kNone && allowed(k - 1, i, j))
          best[k][j] = std::min(best[k][j], std::max(best[k - 1][i], stage_value(k - 1, i, j)));
  return best[stages][layers];
}

}  // namespace

PipelineSplit plan_pipeline_split(const PipelineCosts& costs, int64_t stages, double memory_limit,
                                  const std::string& stages_key, const std::string& memory_key) {
  const StageCosts sc(costs);
  const int64_t layers = sc.layers();
  KILN_CHECK(stages >= 1, stages_key, "{} pipeline stages: at least 1", stages);
  KILN_CHECK(stages <= layers, stages_key, "{} pipeline stages for {} layers: a stage needs at least one layer",
             stages, layers);
  const auto fits = [&](int64_t k, int64_t a, int64_t b) {
    return memory_limit <= 0 || sc.memory(k, a, b) <= memory_limit;
  };
  const auto time = [&](int64_t, int64_t a, int64_t b) { return sc.time(a, b); };
  const double bottleneck = least_bottleneck(layers, stages, time, fits);
  if (bottleneck == kNone) {
    const double least = least_bottleneck(
        layers, stages, [&](int64_t k, int64_t a, int64_t b) { return sc.memory(k, a, b); },
        [](int64_t, int64_t, int64_t) { return true; });
    fail(memory_key, "no split of {} layers into {} stages keeps every stage within {:.4g} GiB: the fullest stage "
         "of the leanest split needs {:.4g} GiB", layers, stages, memory_limit / 1073741824.0, least / 1073741824.0);
  }
  // Among the splits whose slowest stage takes `bottleneck`, the most even (least sum of
  // squared stage times); ties go to the earliest cut, scanned in ascending order.
  std::vector<std::vector<double>> squares(stages + 1, std::vector<double>(layers + 1, kNone));
  std::vector<std::vector<int64_t>> cut(stages + 1, std::vector<int64_t>(layers + 1, -1));
  squares[0][0] = 0;
  for (int64_t k = 1; k <= stages; ++k)
    for (int64_t j = k; j <= layers - (stages - k); ++j)
      for (int64_t i = k - 1; i < j; ++i) {
        if (squares[k - 1][i] == kNone || !fits(k - 1, i, j)) continue;
        const double t = sc.time(i, j);
        if (t > bottleneck) continue;
        const double total = squares[k - 1][i] + t * t;
        if (total < squares[k][j]) {
          squares[k][j] = total;
          cut[k][j] = i;
        }
      }
  PipelineSplit split(static_cast<size_t>(stages));
  for (int64_t k = stages, j = layers; k >= 1; --k) {
    j = cut[k][j];
    split[static_cast<size_t>(k - 1)] = j;
  }
  return split;
}

void validate_pipeline_split(const PipelineSplit& split, int64_t layers, int64_t stages, const std::string& key) {
  KILN_CHECK(!split.empty(), key, "an empty split: give the first layer of each stage, starting at 0");
  KILN_CHECK(stages <= 0 || static_cast<int64_t>(split.size()) == stages, key,
             "{} first layers for {} pipeline stages: give one per stage", split.size(), stages);
  KILN_CHECK(split[0] == 0, key, "the first stage starts at layer {}, not 0: layers 0..{} would be in no stage",
             split[0], split[0] - 1);
  for (size_t s = 1; s < split.size(); ++s)
    KILN_CHECK(split[s] > split[s - 1], key, "stage {} starts at layer {}, not after stage {}'s first layer {}: "
               "stages are contiguous, non-empty and in order", s, split[s], s - 1, split[s - 1]);
  KILN_CHECK(split.back() < layers, key, "stage {} starts at layer {}, but the model has {} layers (0..{})",
             split.size() - 1, split.back(), layers, layers - 1);
}

PipelineSplit parse_pipeline_split(const std::string& text, const std::string& key) {
  PipelineSplit split;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    size_t used = 0;
    int64_t value = -1;
    try {
      value = std::stoll(item, &used);
    } catch (...) {
      used = 0;
    }
    KILN_CHECK(used > 0 && used == item.size() && value >= 0, key,
               "'{}' is not a layer index: give the first layer of each stage, e.g. 0,6,12,18", item);
    split.push_back(value);
  }
  return split;
}

PipelineBalance pipeline_balance(const PipelineCosts& costs, const PipelineSplit& split) {
  const StageCosts sc(costs);
  validate_pipeline_split(split, sc.layers(), 0, "pipeline split");
  PipelineBalance b;
  double total = 0;
  for (size_t s = 0; s < split.size(); ++s) {
    StageBalance stage;
    stage.first = split[s];
    stage.end = s + 1 < split.size() ? split[s + 1] : sc.layers();
    stage.time = sc.time(stage.first, stage.end);
    stage.memory = sc.memory(static_cast<int64_t>(s), stage.first, stage.end);
    stage.in_flight = sc.in_flight(static_cast<int64_t>(s));
    total += stage.time;
    b.max_time = std::max(b.max_time, stage.time);
    b.max_memory = std::max(b.max_memory, stage.memory);
    b.stages.push_back(stage);
  }
  b.mean_time = total / static_cast<double>(split.size());
  b.efficiency = b.max_time > 0 ? b.mean_time / b.max_time : 1.0;
  return b;
}

std::string describe_pipeline_balance(const PipelineCosts& costs, const PipelineBalance& balance) {
  // Estimated times are FLOPs per token, printed in GFLOP; measured ones milliseconds.
  const double scale = costs.measured ? 1.0 : 1e-9;
  const std::string unit = costs.measured ? "ms/micro" : "GFLOP/token";  // the column's
  const std::string per = costs.measured ? "ms per micro-batch" : "GFLOP/token";
  std::string out =
      costs.measured
          ? fmt::format("  time: measured ms per micro-batch on {} (forward + backward of each layer kind); memory: "
                        "estimated from the config\n",
                        costs.measured_on)
          : std::string("  time: estimated GFLOP per token (training FLOPs from the config); memory: estimated from the "
                        "config\n");
  if (!costs.stage_in_flight.empty())
    out += "  memory: with the activations of each stage's micro-batches in flight (the in-flight column)\n";
  fmt::format_to(std::back_inserter(out), "  {:<5} {:<12} {:>12} {:>8} {:>12} {:>9}  {}\n", "stage", "layers", unit,
                 "of max", "memory MiB", "in flight", "layer kinds");
  for (size_t s = 0; s < balance.stages.size(); ++s) {
    const StageBalance& stage = balance.stages[s];
    // Runs of the same kind, in order: "gqa+swiglu x3, kda+swiglu x1".
    std::string kinds;
    for (int64_t l = stage.first; l < stage.end && static_cast<size_t>(l) < costs.layer_kinds.size();) {
      int64_t run = l;
      while (run < stage.end && costs.layer_kinds[run] == costs.layer_kinds[l]) ++run;
      kinds += fmt::format("{}{} x{}", kinds.empty() ? "" : ", ", costs.layer_kinds[l], run - l);
      l = run;
    }
    if (s == 0) kinds += kinds.empty() ? "embedding" : ", embedding";
    if (s + 1 == balance.stages.size()) kinds += kinds.empty() ? "head" : ", head";
    fmt::format_to(std::back_inserter(out), "  {:<5} {:<12} {:>12.4f} {:>8.3f} {:>12.2f} {:>9}  {}\n", s,
                   fmt::format("{}..{} ({})", stage.first, stage.end - 1, stage.end - stage.first), stage.time * scale,
                   balance.max_time > 0 ? stage.time / balance.max_time : 1.0, stage.memory / 1048576.0,
                   stage.in_flight, kinds);
  }
  fmt::format_to(std::back_inserter(out),
                 "predicted balance: slowest stage {:.4f} {}, mean {:.4f}: efficiency {:.3f} (mean / slowest, "
                 "before the schedule's bubble); fullest stage {:.2f} MiB\n",
                 balance.max_time * scale, per, balance.mean_time * scale, balance.efficiency,
                 balance.max_memory / 1048576.0);
  return out;
}

}  // namespace kiln

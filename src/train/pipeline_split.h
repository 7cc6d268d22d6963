// Where to cut the model's layers into pipeline stages (issue 46). A pipeline's step is
// bound by its slowest stage (every stage runs every micro-batch), so the split minimizes
// the slowest stage's time, subject to a memory limit per stage. Model-free: it takes a
// cost per layer, whoever measured or estimated it (train/pipeline_costs.h estimates them
// from the config, train/pipeline_costs_measured.h measures them on the device).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kiln {

// One layer's (or one extra's) cost: time of its forward and backward, in any unit that
// adds up (pipeline_costs.h: training FLOPs per token; pipeline_costs_measured.h:
// milliseconds per micro-batch), and the bytes it keeps.
struct LayerCost {
  double time = 0;
  double memory = 0;
  // The part of `memory` one micro-batch's forward keeps for its backward (saved
  // activations): a stage holding n micro-batches in flight keeps it n times.
  double activations = 0;
};

struct PipelineCosts {
  std::vector<LayerCost> layers;
  LayerCost first_extra;  // the embedding's: on the first stage
  LayerCost last_extra;   // the LM head's, the final norm's and the loss terms': on the last stage
  std::vector<std::string> layer_kinds;  // optional, one per layer ("gqa+swiglu"): printed only
  // What the times are, for the printout: false = training FLOPs per token, estimated; true =
  // milliseconds per micro-batch, measured on `measured_on` ("cpu", "cuda").
  bool measured = false;
  std::string measured_on;
  // Micro-batches each stage keeps in flight (its activation frames), by stage; empty: 1
  // each. A stage's memory counts its layers' activations that many times.
  std::vector<int> stage_in_flight;
};

// A split: the first layer of each stage, ascending, starting at 0 (stage s runs layers
// [first[s], first[s + 1]), the last up to the model's last layer).
using PipelineSplit = std::vector<int64_t>;

struct StageBalance {
  int64_t first = 0, end = 0;  // layers [first, end)
  double time = 0, memory = 0;
  int in_flight = 1;  // micro-batches whose activations memory counts
};
struct PipelineBalance {
  std::vector<StageBalance> stages;
  double max_time = 0, mean_time = 0;
  // Mean stage time / slowest stage time: the share of the slowest stage's pace the others
  // keep busy, before any schedule's bubble (1 = perfectly even).
  double efficiency = 0;
  double max_memory = 0;
};

// The split of costs.layers into `stages` contiguous non-empty ranges whose slowest stage is
// as fast as any split's (exact: dynamic programming over every cut), every stage within
// `memory_limit` (0: none). Among the splits of that slowest time, the one with the least sum
// of squared stage times (the most even), then the earliest cuts: deterministic. Throws one
// line naming `stages_key` when there are more stages than layers, or naming `memory_key`
// and the least memory any split's fullest stage needs when none fits.
PipelineSplit plan_pipeline_split(const PipelineCosts& costs, int64_t stages, double memory_limit = 0,
                                  const std::string& stages_key = "pipeline stages",
                                  const std::string& memory_key = "pipeline memory limit");

// Checks a split given by hand (`key` names where it came from) against `layers` layers and,
// when `stages` > 0, that many stages: starts at 0, strictly ascending, every first layer
// below `layers`. Throws one line naming the key.
void validate_pipeline_split(const PipelineSplit& split, int64_t layers, int64_t stages, const std::string& key);

// Parses "0,6,12,18" (a split given on the command line); throws one line naming `key`.
PipelineSplit parse_pipeline_split(const std::string& text, const std::string& key);

// Each stage's layers, time and memory under `split`, with the extras on the end stages.
PipelineBalance pipeline_balance(const PipelineCosts& costs, const PipelineSplit& split);

// The balance as `kiln plan --pipeline-stages` prints it: where its times come from, a row
// per stage (its layers, time in GFLOP per token when estimated or ms per micro-batch when
// measured, its share of the slowest's, memory in MiB, the kinds of its layers), then the
// slowest and mean stage times and the efficiency.
std::string describe_pipeline_balance(const PipelineCosts& costs, const PipelineBalance& balance);

}  // namespace kiln

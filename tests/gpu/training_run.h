// One short GPU training run read back for the tests that compare captured steps with op-by-op
// steps (MoE routers, MLA, KDA): its train records without what the machine measured, its
// losses, the graphs it launched and every parameter's bytes at the end.
#pragma once

#include "config/config.h"
#include "gpu/gpu_harness.h"
#include "train/trainer.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

namespace kiln::gpu_test {

struct TrainingRun {
  std::vector<std::string> lines;  // metrics.jsonl's train records, timings and memory removed
  std::vector<double> losses;
  nlohmann::json last;  // the last of those records
  std::vector<std::vector<uint8_t>> weights;
  int64_t graph_launches = 0;
};

// Trains `overrides` (which set train.out_dir = out), then reads the run back; `on_record`
// sees each train record as kept.
inline TrainingRun run_training(const std::vector<std::string>& overrides, const std::string& out,
                                const std::function<void(const nlohmann::json&)>& on_record = {}) {
  Trainer trainer(load_config("", overrides));
  trainer.run();
  TrainingRun r;
  r.graph_launches = trainer.graph_launches();
  std::ifstream in(out + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    nlohmann::json j = nlohmann::json::parse(line);
    if (j["kind"] != "train") continue;
    r.losses.push_back(j["loss"].get<double>());
    // What the machine measured (time, memory in use), not what the steps computed.
    for (const char* measured : {"step_seconds", "elapsed_seconds", "tokens_per_second", "mfu", "device_memory_used_bytes",
                                 "host_peak_rss_bytes"})
      j.erase(measured);
    if (on_record) on_record(j);
    r.lines.push_back(j.dump());
    r.last = j;
  }
  for (const auto& p : trainer.model().parameters()) {
    const OwnedTensor host = to_host(p->value());
    const auto* bytes = static_cast<const uint8_t*>(host->raw());
    r.weights.emplace_back(bytes, bytes + host->nbytes());
  }
  return r;
}

// The captured run changed nothing against the op-by-op one: the same records and every
// parameter's bytes.
inline void expect_same_run(const TrainingRun& graphs, const TrainingRun& ops) {
  EXPECT_EQ(graphs.lines, ops.lines);
  ASSERT_EQ(graphs.weights.size(), ops.weights.size());
  for (size_t i = 0; i < ops.weights.size(); ++i) EXPECT_TRUE(graphs.weights[i] == ops.weights[i]) << "parameter " << i;
}

// The mean loss of the run's last `steps` steps.
inline double mean_last_losses(const TrainingRun& r, size_t steps) {
  double mean = 0;
  for (size_t i = r.losses.size() - steps; i < r.losses.size(); ++i) mean += r.losses[i] / static_cast<double>(steps);
  return mean;
}

}  // namespace kiln::gpu_test

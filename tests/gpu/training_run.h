// One short GPU training run read back for the tests that compare captured steps with op-by-op
// steps (MoE routers, MLA, KDA): its train records without what the machine measured, its
// losses, the graphs it launched and every parameter's bytes at the end.
#pragma once

#include "config/config.h"
#include "gpu/gpu_harness.h"
#include "train/trainer.h"

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

}  // namespace kiln::gpu_test

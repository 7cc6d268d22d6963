// Dynamic loss scaling with MoE router losses on the GPU (docs/loss-scaling.md), as
// tests/test_moe_loss_scaling.cpp on the CPU: the balance loss, the router z-loss and the
// relu router's L1 carry the loss scale S, op by op (a host value) and in the captured
// step (S in device memory, read by the router kernels when a graph replays), so a run
// whose S starts at 1024 and doubles every third step trains as the unscaled run.
#include "gpu/gpu_harness.h"
#include "grad_check.h"
#include "test_util.h"
#include "train/trainer.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>

namespace kiln {
namespace {

using namespace gpu_test;

// fp32's rounding: the scaling by a power of two is exact, so a difference is a router
// loss that lost S (then off by a large share of the router's gradient).
constexpr double kTolerance = 1e-6;

struct ScaledRun {
  std::vector<double> losses, grad_norms, scales;
  std::vector<double> weights;
  int64_t graph_launches = 0;
};

ScaledRun train(const std::string& out, const std::string& router, bool graphs, bool dynamic) {
  std::vector<std::string> o = {
      "data.path=" + test::source_dir() + "/data/tinyshakespeare.txt", "train.out_dir=" + out, "train.device=cuda",
      "train.precision=fp32", "train.cuda_graphs=" + std::string(graphs ? "true" : "false"), "model.hidden=64",
      "model.layers=2", "model.heads=4", "model.kv_heads=2", "model.head_dim=16", "model.max_seq_len=128",
      "model.mlp=moe", "model.moe.experts=4", "model.moe.top_k=2", "model.moe.expert_hidden=64",
      "model.moe.router=" + router, "train.micro_batch_tokens=1024", "train.grad_accum=2", "train.steps=12",
      "optim.warmup_steps=3", "optim.lr=3e-3", "optim.grad_clip=0.05", "train.eval_every=0", "train.eval_batches=2",
      "train.sample_every=0", "train.sample_tokens=0", "log.every=1", "checkpoint.save_final=false"};
  // Large coefficients, so the router losses' gradients are a large part of the router's.
  if (router == "relu") o.insert(o.end(), {"model.moe.aux_loss=0", "model.moe.l1_coef=0.05"});
  else o.insert(o.end(), {"model.moe.aux_loss=0.5", "model.moe.z_loss=0.2"});
  if (dynamic)
    o.insert(o.end(), {"train.loss_scale=dynamic", "train.loss_scale_init=1024", "train.loss_scale_growth_interval=3"});
  Trainer trainer(load_config("", o));
  trainer.run();
  ScaledRun r;
  r.graph_launches = trainer.graph_launches();
  std::ifstream in(out + "/metrics.jsonl");
  std::string line;
  while (std::getline(in, line)) {
    const nlohmann::json j = nlohmann::json::parse(line);
    if (j["kind"] != "train") continue;
    r.losses.push_back(j["loss"].get<double>());
    r.grad_norms.push_back(j["grad_norm"].get<double>());
    r.scales.push_back(j.value("loss_scale", 0.0));
  }
  for (const auto& p : trainer.model().parameters()) {
    const OwnedTensor host = to_host(p->value());
    for (int64_t i = 0; i < host->numel(); ++i) r.weights.push_back(host->data<float>()[i]);
  }
  return r;
}

class MoeLossScalingGpu : public GpuTest {};

TEST_F(MoeLossScalingGpu, ScaledRunsWithRouterLossesTrainAsUnscaledOnesOpByOpAndCaptured) {
  const std::string dir = test::temp_dir("kiln-gpu-moe-loss-scale");
  for (const std::string router : {"softmax_topk", "relu"})
    for (const bool graphs : {false, true}) {
      SCOPED_TRACE(router + (graphs ? " captured" : " op by op"));
      const std::string name = dir + "/" + router + (graphs ? "-graphs" : "-ops");
      const ScaledRun plain = train(name + "-plain", router, graphs, false);
      const ScaledRun scaled = train(name + "-scaled", router, graphs, true);
      if (graphs) EXPECT_GT(scaled.graph_launches, 12);  // the graphs replayed across the scale's changes
      ASSERT_EQ(plain.losses.size(), 12u);
      ASSERT_EQ(scaled.scales.size(), 12u);
      EXPECT_EQ(scaled.scales.front(), 1024);
      EXPECT_EQ(scaled.scales.back(), 8192);  // doubled after steps 3, 6 and 9
      EXPECT_LE(test::max_diff_over_max(scaled.losses, plain.losses), kTolerance);
      EXPECT_LE(test::max_diff_over_max(scaled.grad_norms, plain.grad_norms), kTolerance);
      EXPECT_LE(test::max_diff_over_max(scaled.weights, plain.weights), kTolerance);
    }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kiln

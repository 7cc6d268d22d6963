// Sparse models train on the GPU: the captured step (CUDA graphs, every routing size on the
// device) gives the op-by-op step's losses, load diagnostics and weights to the bit; a
// 300-step bf16 run with each router learns as the CPU's does (tests/test_train_moe.cpp,
// the same settings) and keeps every expert.
#include "gpu/gpu_harness.h"
#include "gpu/training_run.h"
#include "test_util.h"
#include "train/trainer.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>

namespace kiln {
namespace {

using namespace gpu_test;

std::vector<std::string> moe_overrides(const std::string& out, const std::string& precision, bool graphs, int64_t steps) {
  return {"data.path=" + test::source_dir() + "/data/tinyshakespeare.txt", "train.out_dir=" + out,
          "train.device=cuda", "train.precision=" + precision, "train.cuda_graphs=" + std::string(graphs ? "true" : "false"),
          "model.hidden=64", "model.layers=2", "model.heads=4", "model.kv_heads=2", "model.head_dim=16",
          "model.max_seq_len=128", "model.mlp=moe", "model.moe.experts=4", "model.moe.top_k=2",
          "model.moe.expert_hidden=64", "train.micro_batch_tokens=2048", "train.steps=" + std::to_string(steps),
          "optim.warmup_steps=20", "optim.lr=3e-3", "train.eval_every=0", "train.eval_batches=2", "train.sample_every=0",
          "train.sample_tokens=20", "checkpoint.save_final=false"};
}

class MoeTrainingGpu : public GpuTest {};

// Every router with its balancing (the loss, the bias, Sinkhorn, expert choice, relu's
// adaptive L1) and the z-loss, softmax_topk with a capacity that drops and without saved
// expert outputs (model.moe.save_outputs = false), two
// micro-batches a step: the graphs ran (launches past the warm-ups) and changed nothing, the
// diagnostics (read back at every log step) included.
TEST_F(MoeTrainingGpu, CapturedStepsMatchTheOpByOpSteps) {
  const std::string dir = test::temp_dir("kiln-gpu-moe-graphs");
  for (const std::string precision : {"bf16", "fp32"})
    for (const std::string variant :
         {"softmax_topk", "sigmoid_bias", "sinkhorn", "expert_choice", "relu", "capacity", "unsaved"}) {
      const std::string router = variant == "capacity" || variant == "unsaved" ? "softmax_topk" : variant;
      SCOPED_TRACE(precision + " " + variant);
      auto run = [&](bool graphs) {
        const std::string out = dir + "/" + precision + "-" + variant + (graphs ? "-graphs" : "-ops");
        std::vector<std::string> o = moe_overrides(out, precision, graphs, 16);
        for (std::string extra : {"model.moe.router=" + router, std::string("model.moe.z_loss=1e-3"),
                                  std::string("train.grad_accum=2"), std::string("train.micro_batch_tokens=1024"),
                                  std::string("log.every=1")})
          o.push_back(extra);
        if (router == "softmax_topk") o.emplace_back("model.moe.aux_loss=0.01");
        if (variant == "capacity") o.emplace_back("model.moe.capacity_factor=0.8");
        if (variant == "unsaved") o.emplace_back("model.moe.save_outputs=false");  // ops::moe_swiglu_backward
        if (router == "expert_choice") o.emplace_back("train.sample_tokens=0");  // not causal: no sampling
        return run_training(o, out);
      };
      const TrainingRun ops = run(false), graphs = run(true);
      EXPECT_EQ(ops.graph_launches, 0);
      EXPECT_GT(graphs.graph_launches, 16);
      ASSERT_EQ(ops.lines.size(), 16u);
      EXPECT_NE(ops.lines.back().find("moe.1.load_max"), std::string::npos) << ops.lines.back();
      expect_same_run(graphs, ops);
    }
  std::filesystem::remove_all(dir);
}

// The CPU test's 300 steps in bf16 with graphs: the loss falls as far, no expert dies, the
// busiest one stays under twice the mean load; the same run twice gives the same bits.
TEST_F(MoeTrainingGpu, Bf16RunsLearnKeepEveryExpertAndRepeat) {
  const std::string dir = test::temp_dir("kiln-gpu-moe-train");
  for (const std::vector<std::string>& router :
       {std::vector<std::string>{"model.moe.aux_loss=0.01"},
        std::vector<std::string>{"model.moe.router=sigmoid_bias", "model.moe.bias_rate=1e-3"}}) {
    SCOPED_TRACE(router[0]);
    auto run = [&](const std::string& name) {
      // A run directory of its own per router and run: metrics.jsonl is appended to.
      const std::string out = dir + "/" + (router.size() == 1 ? "softmax_topk" : "sigmoid_bias") + "-" + name;
      std::vector<std::string> o = moe_overrides(out, "bf16", true, 300);
      o.emplace_back("log.every=50");
      o.insert(o.end(), router.begin(), router.end());
      return run_training(o, out);
    };
    const TrainingRun first = run("first"), second = run("second");
    ASSERT_EQ(first.losses.size(), 6u);
    EXPECT_GT(first.losses.front(), 3.5);
    EXPECT_LT(first.losses.back(), 2.6);
    for (int layer = 0; layer < 2; ++layer) {
      const std::string p = "moe." + std::to_string(layer) + ".";
      ASSERT_TRUE(first.last.contains(p + "dead")) << first.last.dump();
      EXPECT_EQ(first.last[p + "dead"].get<double>(), 0.0) << first.last.dump();
      EXPECT_LT(first.last[p + "load_max"].get<double>(), 2.0) << first.last.dump();
      EXPECT_GT(first.last[p + "entropy"].get<double>(), 0.0) << first.last.dump();
    }
    std::printf("%s: loss %.4f -> %.4f, %s\n", router[0].c_str(), first.losses.front(), first.losses.back(),
                first.last.dump().c_str());
    EXPECT_EQ(first.lines, second.lines);
    for (size_t i = 0; i < first.weights.size(); ++i) EXPECT_TRUE(first.weights[i] == second.weights[i]) << "parameter " << i;
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kiln

// Short training runs through the `kiln` binary with the routers beyond the top-k ones
// (sinkhorn, expert_choice, relu) and with a capacity factor: each learns on the bundled
// corpus (the loss falls clearly in 60 steps), and each router's own diagnostics reach
// metrics.jsonl (relu's L1 term and coefficient, the capacity's drops). Kept short for CI:
// tests/test_train_moe.cpp's 300-step runs check balance at the end for the top-k routers.
#include "test_util.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>

namespace kiln {
namespace {

namespace fs = std::filesystem;

struct RouterRun {
  std::vector<double> losses;  // the logged train losses
  nlohmann::json last;         // the last train record
};

RouterRun train(const std::string& name, const std::string& settings) {
  const std::string dir = test::temp_dir("kiln-train-router-" + name);
  const std::string command =
      test::kiln_binary() + " train " + test::source_dir() + "/configs/default.toml --set data.path=" +
      test::source_dir() + "/data/tinyshakespeare.txt --set train.out_dir=" + dir +
      " --set model.hidden=64 --set model.layers=2 --set model.heads=4 --set model.kv_heads=2"
      " --set model.head_dim=16 --set model.max_seq_len=128 --set model.mlp=moe --set model.moe.experts=4"
      " --set model.moe.top_k=2 --set model.moe.expert_hidden=64 --set train.micro_batch_tokens=1024"
      " --set train.steps=60 --set optim.warmup_steps=10 --set optim.lr=4e-3 --set train.eval_every=0"
      " --set train.eval_batches=1 --set train.sample_every=0 --set train.sample_tokens=0 --set log.every=20"
      " --set train.threads=2 --set checkpoint.every=0 " +
      settings;
  std::string output;
  EXPECT_EQ(test::run_command(command, &output), 0) << output;
  RouterRun run;
  std::ifstream metrics(dir + "/metrics.jsonl");
  std::string line;
  while (std::getline(metrics, line)) {
    const auto j = nlohmann::json::parse(line);
    if (j["kind"] != "train") continue;
    run.losses.push_back(j["loss"].get<double>());
    run.last = j;
  }
  fs::remove_all(dir);
  return run;
}

// From ~ln 259 = 5.6 nats at the start to clearly below: ~4.2 at step 20, ~3.15 at step 60.
void expect_learned(const RouterRun& run) {
  ASSERT_EQ(run.losses.size(), 3u);  // steps 20, 40, 60
  std::printf("train losses at steps 20, 40, 60: %.3f %.3f %.3f\n", run.losses[0], run.losses[1], run.losses[2]);
  EXPECT_LT(run.losses.back(), 3.4) << run.last.dump();                       // measured 3.13-3.18
  EXPECT_LT(run.losses.back(), run.losses.front() - 0.6) << run.last.dump();  // from ~4.2 at step 20
  for (int layer = 0; layer < 2; ++layer)
    EXPECT_TRUE(run.last.contains("moe." + std::to_string(layer) + ".load_max")) << run.last.dump();
}

TEST(TrainMoeRouters, SinkhornLearns) { expect_learned(train("sinkhorn", "--set model.moe.router=sinkhorn")); }

TEST(TrainMoeRouters, ExpertChoiceLearnsWithEveryExpertEquallyLoaded) {
  const RouterRun run = train("expert-choice", "--set model.moe.router=expert_choice");
  expect_learned(run);
  EXPECT_NEAR(run.last["moe.0.load_max"].get<double>(), 1.0, 1e-9) << run.last.dump();  // C tokens each
}

TEST(TrainMoeRouters, ReluLearnsWithItsAdaptiveL1) {
  const RouterRun run = train("relu", "--set model.moe.router=relu --set model.moe.l1_coef=1e-4");
  expect_learned(run);
  ASSERT_TRUE(run.last.contains("moe_l1")) << run.last.dump();
  EXPECT_GT(run.last["moe_l1"].get<double>(), 0.0);
  ASSERT_TRUE(run.last.contains("moe.0.l1_coef")) << run.last.dump();
  EXPECT_NE(run.last["moe.0.l1_coef"].get<double>(), 1e-4);  // adapted every step
}

TEST(TrainMoeRouters, CapacityFactorLearnsAndReportsItsDrops) {
  const RouterRun run = train("capacity", "--set model.moe.router=softmax_topk --set model.moe.capacity_factor=1.0 "
                        "--set model.moe.aux_loss=0.01");
  expect_learned(run);
  ASSERT_TRUE(run.last.contains("moe.0.dropped")) << run.last.dump();
  EXPECT_GE(run.last["moe.0.dropped"].get<double>(), 0.0);
  EXPECT_LT(run.last["moe.0.dropped_share"].get<double>(), 0.5);
}

}  // namespace
}  // namespace kiln

// A sparse model trains on the bundled corpus through the `kiln` binary with each router:
// the loss falls past the unigram plateau, the step's losses and the experts' load reach
// metrics.jsonl, and at the end every expert carries between half and 1.5x the mean load
// (softmax_topk balanced by its auxiliary loss, sigmoid_bias by its bias).
//
// 300 steps because the balancing takes them: at step 200 the busiest expert of the runs
// below was still at up to 1.72x the mean with sigmoid_bias (its bias moves 0.001 a step)
// and 1.64x with softmax_topk. 1024 tokens a step (8 sequences of 128; 2048 before) since
// the balance and the loss need the steps more than the tokens: over train.seed 1337 (the
// test's), 1, 2, 3 and 4 with 2 threads, the last step's load across both layers was
// 1.11-1.36x at most and 0.65-0.92x at least, the mean loss of steps 251-300 2.37-2.48 and
// the bias's spread in each layer 0.12-0.56. With the balancing off (model.moe.aux_loss=0,
// or bias_rate=0) 9 of those 10 runs leave an expert above 1.5x or below 0.5x at step 300,
// the test's own seed among them for both routers (2.00x / 0.00x and 1.67x / 0.42x); the
// bound before, load_max under 2.0, passed them all (with 4 experts top 2 the busiest
// cannot exceed 2x).
#include "test_util.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>

namespace kiln {
namespace {

namespace fs = std::filesystem;

struct TrainedRun {
  std::vector<double> losses;  // the logged train losses
  nlohmann::json last;         // the last train record
};

TrainedRun train_moe(const std::string& dir, const std::string& router_settings) {
  const std::string command =
      test::kiln_binary() + " train " + test::source_dir() + "/configs/default.toml --set data.path=" +
      test::source_dir() + "/data/tinyshakespeare.txt --set train.out_dir=" + dir +
      " --set model.hidden=64 --set model.layers=2 --set model.heads=4 --set model.kv_heads=2"
      " --set model.head_dim=16 --set model.max_seq_len=128 --set model.mlp=moe --set model.moe.experts=4"
      " --set model.moe.top_k=2 --set model.moe.expert_hidden=64 --set train.micro_batch_tokens=1024"
      " --set train.steps=300 --set optim.warmup_steps=20 --set optim.lr=3e-3 --set train.eval_every=0"
      " --set train.eval_batches=2 --set train.sample_every=0 --set train.sample_tokens=20 --set log.every=50"
      " --set train.threads=2 --set checkpoint.every=0 " +
      router_settings;
  std::string output;
  EXPECT_EQ(test::run_command(command, &output), 0) << output;
  EXPECT_NE(output.find("step   300/300"), std::string::npos) << output;
  EXPECT_NE(output.find("experts max load"), std::string::npos) << output;
  TrainedRun run;
  std::ifstream metrics(dir + "/metrics.jsonl");
  std::string line;
  while (std::getline(metrics, line)) {
    const auto j = nlohmann::json::parse(line);
    if (j["kind"] != "train") continue;
    run.losses.push_back(j["loss"].get<double>());
    run.last = j;
  }
  return run;
}

void expect_learned_and_balanced(const TrainedRun& run) {
  ASSERT_EQ(run.losses.size(), 6u);  // every 50 of 300 steps
  EXPECT_GT(run.losses.front(), 3.5);
  EXPECT_LT(run.losses.back(), 2.6);
  for (int layer = 0; layer < 2; ++layer) {
    const std::string p = "moe." + std::to_string(layer) + ".";
    ASSERT_TRUE(run.last.contains(p + "dead")) << run.last.dump();
    EXPECT_EQ(run.last[p + "dead"].get<double>(), 0.0) << run.last.dump();
    EXPECT_LT(run.last[p + "load_max"].get<double>(), 1.5) << run.last.dump();  // of the mean load
    EXPECT_GT(run.last[p + "load_min"].get<double>(), 0.5) << run.last.dump();
    EXPECT_GT(run.last[p + "entropy"].get<double>(), 0.0);
  }
}

TEST(TrainMoe, SoftmaxTopKWithTheBalanceLossLearnsAndKeepsEveryExpert) {
  const std::string dir = test::temp_dir("kiln-train-moe-softmax");
  const TrainedRun run = train_moe(dir, "--set model.moe.router=softmax_topk --set model.moe.aux_loss=0.01 "
                                 "--set model.moe.z_loss=0.001");
  expect_learned_and_balanced(run);
  ASSERT_TRUE(run.last.contains("moe_aux")) << run.last.dump();
  EXPECT_GT(run.last["moe_aux"].get<double>(), 0.0);
  EXPECT_TRUE(run.last.contains("moe_z"));
  // The sparse model decodes: kiln sample loads what the run saved.
  std::string output;
  ASSERT_EQ(test::run_command(test::kiln_binary() + " sample " + dir + "/model -p 'KING' -n 20 --seed 2", &output), 0)
      << output;
  EXPECT_EQ(output.rfind("KING", 0), 0u) << output;
  fs::remove_all(dir);
}

TEST(TrainMoe, SigmoidBiasBalancesWithoutALoss) {
  const std::string dir = test::temp_dir("kiln-train-moe-sigmoid");
  const TrainedRun run = train_moe(dir, "--set model.moe.router=sigmoid_bias --set model.moe.bias_rate=0.001");
  expect_learned_and_balanced(run);
  EXPECT_FALSE(run.last.contains("moe_aux"));
  for (int layer = 0; layer < 2; ++layer) {  // the bias moved (0 apart with bias_rate=0)
    const std::string p = "moe." + std::to_string(layer) + ".";
    ASSERT_TRUE(run.last.contains(p + "bias_max")) << run.last.dump();
    EXPECT_GT(run.last[p + "bias_max"].get<double>() - run.last[p + "bias_min"].get<double>(), 0.05)
        << run.last.dump();
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace kiln

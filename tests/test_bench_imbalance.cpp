// `kiln bench --imbalance R` on the CPU: the sigmoid_bias layers' busiest expert is held
// at R x the mean load through the timed steps (bench_imbalance.h), and a model it cannot
// steer is refused by name. Also what a CPU bench prints: no GPU figures (MFU), and no
// op shown with 0 calls per step.
#include "test_util.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <regex>
#include <string>

namespace kiln {
namespace {

// bench-moe-shared's layout (sigmoid_bias, 32 experts top 4, a shared expert, a dense
// first layer) at a size the CPU times in seconds; 2048 tokens, so the natural busiest
// expert stays far below 4x the mean.
const std::string kTiny =
    " --set model.layers=3 --set model.hidden=64 --set model.heads=4 --set model.kv_heads=2 --set model.head_dim=16"
    " --set model.vocab_size=512 --set model.max_seq_len=256 --set train.micro_batch_tokens=2048"
    " --set model.ffn_hidden=128 --set model.moe.expert_hidden=32 --set model.moe.shared_hidden=32"
    " --set train.device=cpu --set train.precision=fp32 --steps 1 --warmup 0";

std::string bench(const std::string& config, const std::string& extra, int* code) {
  std::string output;
  *code = test::run_command(test::kiln_binary() + " bench " + test::source_dir() + "/configs/" + config + kTiny + extra +
                                " 2>&1",
                            &output);
  return output;
}

TEST(BenchImbalance, HoldsTheBusiestExpertAtTheAskedLoad) {
  int code = 0;
  const std::string out = bench("bench-moe-shared.toml", " --imbalance 4", &code);
  ASSERT_EQ(code, 0) << out;
  std::printf("%s", out.substr(0, out.find("per op")).c_str());
  std::smatch m;
  ASSERT_TRUE(std::regex_search(out, m, std::regex(R"(routing held uneven: load_max ([0-9.]+)-([0-9.]+) over 2 layers)")))
      << out;
  ASSERT_TRUE(std::regex_search(out, m, std::regex(R"(routing in the last timed step: load_max ([0-9.]+)-([0-9.]+))")))
      << out;
  EXPECT_GE(std::stod(m[1]), 3.6) << "every sparse layer still near 4x after the timed steps";
  EXPECT_LE(std::stod(m[2]), 4.4);

  const std::string natural = bench("bench-moe-shared.toml", " --set optim.lr=1e-9", &code);
  ASSERT_EQ(code, 0) << natural;
  ASSERT_TRUE(std::regex_search(natural, m, std::regex(R"(routing in the last timed step: load_max [0-9.]+-([0-9.]+))")));
  EXPECT_LT(std::stod(m[1]), 2.5) << "without --imbalance the load stays near even";
}

TEST(BenchImbalance, RefusesARouterWithoutABias) {
  int code = 0;
  const std::string out = bench("bench-moe-1b.toml", " --set model.moe.experts=8 --imbalance 2", &code);
  EXPECT_NE(code, 0);
  EXPECT_NE(out.find("--imbalance needs sparse layers routed by sigmoid_bias"), std::string::npos) << out;
}

TEST(BenchCpu, PrintsNoGpuFiguresAndNoOpWithZeroCalls) {
  int code = 0;
  const std::string json = test::temp_dir("kiln-bench-cpu") + "/bench.jsonl";
  const std::string out = bench("bench-moe-shared.toml", " --json " + json, &code);
  ASSERT_EQ(code, 0) << out;
  EXPECT_EQ(out.find("MFU"), std::string::npos) << out;
  EXPECT_NE(out.find("model TFLOP/s"), std::string::npos) << out;
  EXPECT_FALSE(std::regex_search(out, std::regex(R"( 0 calls)"))) << out;
  EXPECT_TRUE(std::regex_search(out, std::regex(R"( [0-9.]+ calls)"))) << out;
  std::string line;
  ASSERT_EQ(test::run_command("cat " + json, &line), 0);
  EXPECT_NE(line.find("\"mfu\":null"), std::string::npos) << line;
}

}  // namespace
}  // namespace kiln

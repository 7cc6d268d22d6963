// `kiln bench` under natural routing, on the CPU: --tokens data times the run's own training
// micro-batches, and --init (train.init_from) starts from a trained run's model, so the
// first timed step's loss is the trained model's, far below the ln(vocab) of fresh weights;
// the JSON line records both choices, and bad paths are one-line errors naming the key
// (train.init_from) or the data reader ([data], as kiln train says it).
#include "test_util.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <regex>
#include <string>

namespace kiln {
namespace {

// bench-moe-shared's layout (sigmoid_bias, 32 experts top 4, a shared expert, a dense
// first layer) at a size the CPU runs in seconds, as test_bench_imbalance's.
const std::string kShape =
    " --set model.layers=3 --set model.hidden=64 --set model.heads=4 --set model.kv_heads=2 --set model.head_dim=16"
    " --set model.vocab_size=512 --set model.max_seq_len=256 --set model.ffn_hidden=128"
    " --set model.moe.expert_hidden=32 --set model.moe.shared_hidden=32 --set train.device=cpu"
    " --set train.precision=fp32 --set train.threads=2";
const std::string kConfig = test::source_dir() + "/configs/bench-moe-shared.toml";
const std::string kCorpus = test::source_dir() + "/data/tinyshakespeare.txt";
const double kLnVocab = std::log(512.0);

std::string bench(const std::string& extra, int* code) {
  std::string output;
  *code = test::run_command(test::kiln_binary() + " bench " + kConfig + kShape +
                                " --set train.micro_batch_tokens=2048 --steps 2 --warmup 0" + extra + " 2>&1",
                            &output);
  return output;
}

// "loss first F, last L": F.
double first_loss(const std::string& out) {
  std::smatch m;
  if (!std::regex_search(out, m, std::regex(R"(loss first ([0-9.]+), last)"))) return NAN;
  return std::stod(m[1]);
}

nlohmann::json json_line(const std::string& path) {
  std::string text;
  EXPECT_EQ(test::run_command("cat " + path, &text), 0);
  return nlohmann::json::parse(text);
}

TEST(BenchNatural, TimesTheRunsTrainingDataFromFreshWeights) {
  const std::string json = test::temp_dir("kiln-bench-data") + "/bench.jsonl";
  int code = 0;
  const std::string out = bench(" --tokens data --set data.path=" + kCorpus + " --json " + json, &code);
  ASSERT_EQ(code, 0) << out;
  EXPECT_NE(out.find("tokens per step (training data " + kCorpus + ", fresh weights)"), std::string::npos) << out;
  EXPECT_TRUE(std::regex_search(out, std::regex(R"(routing in the last timed step: load_max [0-9.]+-[0-9.]+ over 2 layers)")))
      << out;
  EXPECT_NEAR(first_loss(out), kLnVocab, 0.5) << "fresh weights guess about uniformly\n" << out;
  const nlohmann::json j = json_line(json);
  EXPECT_EQ(j["tokens"], "data");
  EXPECT_EQ(j["data"], kCorpus);
  EXPECT_EQ(j["init_from"], "");
}

TEST(BenchNatural, StartsFromATrainedRunsModel) {
  const std::string dir = test::temp_dir("kiln-bench-init");
  std::string output;
  ASSERT_EQ(test::run_command(test::kiln_binary() + " train " + kConfig + kShape + " --set data.path=" + kCorpus +
                                  " --set train.out_dir=" + dir + "/run --set train.micro_batch_tokens=1024"
                                  " --set train.steps=20 --set optim.warmup_steps=3 --set optim.lr=1e-2"
                                  " --set train.eval_every=0 --set train.eval_batches=0 --set train.sample_every=0"
                                  " --set train.sample_tokens=0 --set checkpoint.every=0 2>&1",
                              &output),
            0)
      << output;
  const std::string json = dir + "/bench.jsonl";
  int code = 0;
  const std::string out =
      bench(" --tokens data --set data.path=" + kCorpus + " --init " + dir + "/run/model --json " + json, &code);
  ASSERT_EQ(code, 0) << out;
  EXPECT_NE(out.find("weights from " + dir + "/run/model)"), std::string::npos) << out;
  EXPECT_TRUE(std::regex_search(out, std::regex(R"(routing in the last timed step: load_max [0-9.]+-[0-9.]+ over 2 layers)")))
      << out;
  // Fresh weights score ~ln(512) = 6.24 on the same batches (the test above).
  EXPECT_LT(first_loss(out), kLnVocab - 1.5) << "the trained weights were not loaded\n" << out;
  const nlohmann::json j = json_line(json);
  EXPECT_EQ(j["tokens"], "data");
  EXPECT_EQ(j["init_from"], dir + "/run/model");

  // train.init_from in the config (or --set) is honoured as --init is.
  const std::string via_key = bench(" --set train.init_from=" + dir + "/run", &code);
  ASSERT_EQ(code, 0) << via_key;
  EXPECT_NE(via_key.find("(random tokens, weights from "), std::string::npos) << via_key;
}

// Runs a bench expected to fail; its output, which must be one error line.
std::string one_line_error(const std::string& extra) {
  int code = 0;
  const std::string out = bench(extra, &code);
  EXPECT_NE(code, 0) << out;
  EXPECT_EQ(out.rfind("kiln: error: ", 0), 0u) << out;
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1) << "not one line:\n" << out;
  return out;
}

TEST(BenchNatural, BadPathsAreOneLineErrorsNamingTheKey) {
  const std::string missing = test::temp_dir("kiln-bench-bad") + "/missing";
  EXPECT_NE(one_line_error(" --init " + missing).find("[train.init_from]"), std::string::npos);
  // The data readers' own error, as `kiln train` gives it.
  EXPECT_NE(one_line_error(" --tokens data --set data.path=" + missing + ".txt").find("[data] cannot open '" + missing),
            std::string::npos);
  int code = 0;  // CLI11 refuses a value outside random|data, naming the option
  const std::string out = bench(" --tokens text", &code);
  EXPECT_NE(code, 0) << out;
  EXPECT_NE(out.find("--tokens"), std::string::npos) << out;
}

}  // namespace
}  // namespace kiln

// End-to-end tests of the `kiln` binary: a short training run that learns, sampling
// from what it saved, and one-line errors for every kind of bad input.
#include "core/device_choice.h"
#include "core/device_memory.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

namespace kiln {
namespace {

namespace fs = std::filesystem;

// A small, fast run on the bundled corpus; extra overrides are appended.
std::string train_command(const std::string& out_dir, const std::string& extra = "") {
  return test::kiln_binary() + " train " + KILN_SOURCE_DIR "/configs/default.toml" +
         " --set data.path=" KILN_SOURCE_DIR "/data/tinyshakespeare.txt --set train.out_dir=" + out_dir +
         " --set model.hidden=64 --set model.layers=2 --set model.heads=4 --set model.kv_heads=2"
         " --set model.head_dim=16 --set model.ffn_hidden=128 --set model.max_seq_len=128"
         " --set train.micro_batch_tokens=2048 --set train.steps=300 --set optim.warmup_steps=20"
         " --set optim.lr=3e-3 --set train.eval_every=0 --set train.eval_batches=2 --set train.sample_every=0"
         " --set train.sample_tokens=20 --set log.every=50 --set train.threads=2 " +
         extra;
}

// Runs a command expected to fail; returns its output, which must be a single error line.
std::string expect_one_line_error(const std::string& command) {
  std::string output;
  const int code = test::run_command(command, &output);
  EXPECT_NE(code, 0) << "expected failure: " << command << "\n" << output;
  EXPECT_EQ(output.rfind("kiln: error: ", 0), 0u) << output;
  EXPECT_EQ(std::count(output.begin(), output.end(), '\n'), 1) << "not one line:\n" << output;
  return output;
}

TEST(Cli, ShortTrainingRunLearnsAndSavesWhatSampleLoads) {
  const std::string dir = test::temp_dir("kiln-cli-train");
  std::string output;
  ASSERT_EQ(test::run_command(train_command(dir), &output), 0) << output;
  EXPECT_NE(output.find("step   300/300"), std::string::npos) << output;
  EXPECT_NE(output.find("sample at step 300"), std::string::npos) << output;

  // The metrics file has every 50th step; the loss fell from the uniform-guess ln(259) =
  // 5.56 nats, past the unigram plateau (~3.2), to under 2.5 nats in 300 steps (fixed seeds;
  // measured 2.24 train, 2.23 validation).
  std::ifstream metrics(dir + "/metrics.jsonl");
  std::string line;
  std::vector<double> train_losses;
  double validation = -1;
  while (std::getline(metrics, line)) {
    const auto j = nlohmann::json::parse(line);
    if (j["kind"] == "train") train_losses.push_back(j["loss"].get<double>());
    if (j["kind"] == "validation") validation = j["loss"].get<double>();
  }
  ASSERT_EQ(train_losses.size(), 6u);  // every 50 of 300 steps
  EXPECT_GT(train_losses.front(), 3.5);
  EXPECT_LT(train_losses.back(), 2.5);
  EXPECT_GT(validation, 0);
  EXPECT_LT(validation, 2.5);

  // The resolved config and the model were saved; sample loads them.
  EXPECT_TRUE(fs::exists(dir + "/config.toml"));
  EXPECT_TRUE(fs::exists(dir + "/model/model.safetensors"));
  ASSERT_EQ(test::run_command(test::kiln_binary() + " sample " + dir + "/model --prompt 'KING' -n 40 --seed 3", &output), 0)
      << output;
  EXPECT_EQ(output.rfind("KING", 0), 0u) << output;
  EXPECT_GT(output.size(), 10u);
  // --device: cpu is the CPU decoder; cuda without a GPU is a one-line error (the GPU
  // machine samples with --device cuda in tests/gpu).
  ASSERT_EQ(test::run_command(test::kiln_binary() + " sample " + dir + "/model -p 'KING' -n 8 --device cpu", &output), 0)
      << output;
  EXPECT_EQ(output.rfind("KING", 0), 0u) << output;
  if (!cuda_available())
    EXPECT_NE(expect_one_line_error(test::kiln_binary() + " sample " + dir + "/model --device cuda").find("cuda"),
              std::string::npos);
  fs::remove_all(dir);
}

TEST(Cli, SameSeedSameLosses) {
  const std::string a = test::temp_dir("kiln-cli-a"), b = test::temp_dir("kiln-cli-b");
  const std::string extra = "--set train.steps=10 --set log.every=1 --set checkpoint.save_final=false";
  ASSERT_EQ(test::run_command(train_command(a, extra), nullptr), 0);
  ASSERT_EQ(test::run_command(train_command(b, extra), nullptr), 0);
  auto losses = [](const std::string& dir) {
    std::ifstream in(dir + "/metrics.jsonl");
    std::vector<double> out;
    std::string line;
    while (std::getline(in, line)) {
      const auto j = nlohmann::json::parse(line);
      if (j["kind"] == "train") out.push_back(j["loss"]);
    }
    return out;
  };
  const auto la = losses(a), lb = losses(b);
  ASSERT_EQ(la.size(), 10u);
  EXPECT_EQ(la, lb);  // bitwise: same seed, same thread count, same binary
  fs::remove_all(a);
  fs::remove_all(b);
}

TEST(Cli, BadInputGivesOneLineErrors) {
  const std::string dir = test::temp_dir("kiln-cli-bad");
  const std::string kiln = test::kiln_binary();
  test::write_file(dir + "/malformed.toml", "[model]\nlayers = = 3\n");
  test::write_file(dir + "/unknown.toml", "[model]\nlayerz = 3\n");
  test::write_file(dir + "/empty.txt", "");
  test::write_file(dir + "/ok.toml", "[train]\nsteps = 1\n");

  EXPECT_NE(expect_one_line_error(kiln + " train " + dir + "/malformed.toml").find("malformed.toml:2"),
            std::string::npos);
  EXPECT_NE(expect_one_line_error(kiln + " train " + dir + "/unknown.toml").find("model.layerz"), std::string::npos);
  EXPECT_NE(expect_one_line_error(kiln + " train " + dir + "/missing.toml").find("missing.toml"), std::string::npos);
  EXPECT_NE(expect_one_line_error(kiln + " train " + dir + "/ok.toml --set data.path=" + dir + "/nothere.txt")
                .find("nothere.txt"),
            std::string::npos);
  EXPECT_NE(expect_one_line_error(kiln + " train " + dir + "/ok.toml --set data.path=" + dir + "/empty.txt")
                .find("empty.txt"),
            std::string::npos);
  EXPECT_NE(expect_one_line_error(kiln + " train " + dir + "/ok.toml --set model.layers=abc").find("model.layers"),
            std::string::npos);
  EXPECT_NE(expect_one_line_error(kiln + " train " + dir + "/ok.toml --set nodot").find("nodot"), std::string::npos);
  EXPECT_NE(expect_one_line_error(kiln + " train " + dir + "/ok.toml --set model.heads=5").find("model.heads"),
            std::string::npos);
  EXPECT_NE(expect_one_line_error(kiln + " train " + dir + "/ok.toml --set model.norm=groupnorm").find("groupnorm"),
            std::string::npos);
  EXPECT_NE(expect_one_line_error(kiln + " sample " + dir + "/no-model").find("no-model"), std::string::npos);
  EXPECT_NE(expect_one_line_error(kiln + " train " + dir + "/ok.toml --set model.kda.gpu_kernel=fast")
                .find("model.kda.gpu_kernel"),
            std::string::npos);
  fs::remove_all(dir);
}

// kiln bench-kda times GPU kernels: on a machine without one it says so in one line.
TEST(Cli, BenchKdaNeedsAGpu) {
  if (resolve_device("auto") == Device::cuda) GTEST_SKIP() << "this machine has a GPU";
  EXPECT_NE(expect_one_line_error(test::kiln_binary() + " bench-kda --batch 1 --seq 64").find("needs a CUDA GPU"),
            std::string::npos);
}

// Found by the config fuzz target (tests/fuzz/corpus/config/regression_*): an error that
// quotes user text (a --set key or value, a TOML key) printed a newline in it raw, so the
// one-line error became several. Such bytes are now shown as \x0a.
TEST(Cli, ErrorsQuotingUserTextStayOneLine) {
  const std::string dir = test::temp_dir("kiln-cli-newline");
  const std::string plan = test::kiln_binary() + " plan " + dir;
  test::write_file(dir + "/key.toml", "[model]\n\"lay\\ners\" = 3\n");  // a quoted TOML key holding "\n"
  test::write_file(dir + "/ok.toml", "[train]\nsteps = 1\n");
  auto set = [](const char* assignment) { return std::string(" --set \"$(printf '") + assignment + "')\""; };
  EXPECT_NE(expect_one_line_error(plan + "/key.toml").find("unknown key 'model.lay\\x0aers'"), std::string::npos);
  test::write_file(dir + "/parse.toml", "[model]\nqk_norm = tru\n");  // toml++'s message quotes "tru\n"
  EXPECT_NE(expect_one_line_error(plan + "/parse.toml").find("parse.toml:2:14: Error while parsing boolean"),
            std::string::npos);
  EXPECT_NE(expect_one_line_error(plan + "/ok.toml" + set("model.lay\\ners=3")).find("unknown key 'model.lay\\x0aers'"),
            std::string::npos);
  EXPECT_NE(expect_one_line_error(plan + "/ok.toml" + set("model.layers=3\\nx")).find("'3\\x0ax' is not an integer"),
            std::string::npos);
  EXPECT_NE(expect_one_line_error(plan + "/ok.toml" + set("model.norm=rms\\nnorm")).find("'rms\\x0anorm'"),
            std::string::npos);
  EXPECT_NE(expect_one_line_error(plan + "/ok.toml" + set("no\\ndot")).find("--set 'no\\x0adot'"), std::string::npos);
  fs::remove_all(dir);
}

// `kiln list` names every registered component under the keys that choose it: the norms,
// token mixers, MLPs and the rest, each line "  <name> <description>" below its
// "<kind>s (<key>[, <key>]):" header.
TEST(Cli, ListShowsEachComponentUnderItsKey) {
  std::string output;
  ASSERT_EQ(test::run_command(test::kiln_binary() + " list", &output), 0) << output;
  std::map<std::string, std::set<std::string>> names;  // key -> the names listed under it
  std::istringstream lines(output);
  std::string line, key;
  while (std::getline(lines, line)) {
    if (line.rfind("  ", 0) == 0) {
      names[key].insert(line.substr(2, line.find(' ', 2) - 2));
    } else {  // a header: the key in parentheses, or none ("tokenizer:")
      const size_t open = line.find(" ("), close = line.rfind("):");
      key = open != std::string::npos && close != std::string::npos ? line.substr(open + 2, close - open - 2) : line;
      key = key.substr(0, key.find(", "));  // the first of the keys: model.attention, model.alt_attention
    }
  }
  for (const char* norm : {"rmsnorm", "layernorm", "layernorm_nobias", "gemma_rmsnorm", "dyt"})
    EXPECT_TRUE(names["model.norm"].count(norm)) << norm << "\n" << output;
  for (const char* mlp : {"swiglu", "geglu", "gelu", "relu2", "moe"})
    EXPECT_TRUE(names["model.mlp"].count(mlp)) << mlp << "\n" << output;
  EXPECT_FALSE(names["model.norm"].count("gelu")) << output;  // each under its own key only
  EXPECT_TRUE(names["model.attention"].count("gqa")) << output;
  EXPECT_TRUE(names["model.attention"].count("kda")) << output;
  EXPECT_NE(output.find("token mixers (model.attention, model.alt_attention):"), std::string::npos) << output;
}

TEST(Cli, PlanReportsWithoutAllocating) {
  std::string output;
  // A 1.5B-shaped config: planning must not allocate its tens of GiB.
  ASSERT_EQ(test::run_command(test::kiln_binary() + " plan " KILN_SOURCE_DIR "/configs/default.toml"
                              " --set model.hidden=2048 --set model.layers=28 --set model.heads=16"
                              " --set model.kv_heads=8 --set model.head_dim=128 --set model.ffn_hidden=6144"
                              " --set model.vocab_size=65536 --set model.max_seq_len=4096"
                              " --set train.micro_batch_tokens=16384",
                              &output),
            0)
      << output;
  EXPECT_NE(output.find("parameters"), std::string::npos);
  EXPECT_NE(output.find("activations"), std::string::npos);
  EXPECT_NE(output.find("FLOPs per token"), std::string::npos);
}

// Per-rank memory at 4 ranks: ZeRO-1 keeps about a quarter of DDP's optimizer state, and a
// gather buffer of dist.bucket_mb (here 1 MiB; the default 25 MiB is more than this model's
// parameters, which then go in one round); the rest is DDP's.
TEST(Cli, PlanPrintsEachRanksMemoryWithAndWithoutZero) {
  std::string output;
  ASSERT_EQ(test::run_command(test::kiln_binary() + " plan " KILN_SOURCE_DIR
                                                    "/configs/default.toml --world-size 4 --set dist.bucket_mb=1",
                              &output),
            0)
      << output;
  const auto columns = [&](const std::string& mode) {
    const size_t at = output.find("\n  " + mode + " ");
    EXPECT_NE(at, std::string::npos) << output;
    std::istringstream line(output.substr(at + 3 + mode.size()));
    std::vector<double> v(6);
    for (double& x : v) line >> x;
    return v;  // parameters, gradients, optimizer, gather buffer, activations, total
  };
  const std::vector<double> ddp = columns("DDP"), zero = columns("ZeRO-1");
  EXPECT_EQ(ddp[0], zero[0]);
  EXPECT_EQ(ddp[1], zero[1]);
  EXPECT_EQ(ddp[3], 0.0);
  EXPECT_NEAR(zero[2], ddp[2] / 4, ddp[2] * 0.02) << output;  // a quarter, within the cuts' alignment
  EXPECT_NEAR(zero[3], 1.0, 0.01) << output;                   // 4 x a quarter of 1 MiB
  EXPECT_NEAR(zero[5] - ddp[5], zero[2] - ddp[2] + zero[3], 0.02) << output;
  // ZeRO-2: ZeRO-1's but for the gradients, a quarter of them plus what backward holds
  // before its buckets are reduce-scattered (two blocks', the heads' and the table's: with
  // the reduce-scatters overlapping backward, 4.74 of 6.20 MiB for this model's 4 blocks).
  const std::vector<double> two = columns("ZeRO-2");
  for (size_t c : {0, 2, 3, 4}) EXPECT_EQ(two[c], zero[c]) << "column " << c;
  EXPECT_GT(two[1], ddp[1] / 4) << output;
  EXPECT_LT(two[1], ddp[1] * 0.8) << output;
  EXPECT_NEAR(two[5] - zero[5], two[1] - zero[1], 0.02) << output;
}

// ZeRO-2 with dist.bucket_mb = 0 reduce-scatters after backward: it holds the whole arena.
TEST(Cli, PlanGivesZeroTwoTheWholeGradientsWithoutBuckets) {
  std::string output;
  ASSERT_EQ(test::run_command(test::kiln_binary() + " plan " KILN_SOURCE_DIR
                                                    "/configs/default.toml --world-size 4 --set dist.bucket_mb=0",
                              &output),
            0)
      << output;
  const auto gradients = [&](const std::string& mode) {
    const size_t at = output.find("\n  " + mode + " ");
    EXPECT_NE(at, std::string::npos) << output;
    std::istringstream line(output.substr(at + 3 + mode.size()));
    double parameters = 0, g = 0;
    line >> parameters >> g;
    return g;
  };
  EXPECT_EQ(gradients("ZeRO-2"), gradients("DDP"));
}

}  // namespace
}  // namespace kiln

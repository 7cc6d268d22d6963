// `kiln loss-gap` (cli/loss_gap_command.cpp, plot/loss_gap.h): the gap and the noise floor
// computed from metrics records by hand, the runs it trains and the verdict it gives (a
// harmless change inside the noise, a learning rate cut 1000x outside it), and its refusals,
// each before any run is trained.
#include "plot/loss_gap.h"
#include "test_util.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <string>
#include <vector>

namespace kiln {
namespace {

namespace fs = std::filesystem;
using plot::RunMetrics;

// A metrics file's records: train records at the given steps and losses ("null": none).
RunMetrics metrics(const std::string& label, const std::vector<std::pair<int64_t, std::string>>& train,
                   const std::vector<std::pair<int64_t, double>>& validation = {}) {
  std::string text;
  for (const auto& [step, loss] : train)
    text += fmt::format(R"({{"kind":"train","step":{},"loss":{},"lr":0.001,"grad_norm":1.0,"tokens":100,)"
                        R"("step_seconds":0.1}})"
                        "\n",
                        step, loss);
  for (const auto& [step, loss] : validation)
    text += fmt::format(R"({{"kind":"validation","step":{},"loss":{}}})"
                        "\n",
                        step, loss);
  RunMetrics run = plot::parse_metrics(text, label + "/metrics.jsonl");
  run.label = label;
  return run;
}

TEST(LossGap, MeasuresTheGapAgainstTheSeedsNoiseAtTheStepsAllThreeLogged) {
  const RunMetrics base = metrics("base", {{10, "3.0"}, {20, "2.5"}, {30, "2.0"}}, {{30, 2.1}});
  const RunMetrics second = metrics("second", {{10, "3.2"}, {20, "2.4"}, {30, "2.1"}, {40, "9.0"}}, {{30, 2.2}});
  const RunMetrics cand = metrics("cand", {{10, "3.05"}, {20, "2.55"}, {25, "7.0"}, {30, "1.95"}}, {{30, 2.0}});
  const plot::LossGap gap = plot::measure_loss_gap(base, second, cand);
  // Steps 10, 20, 30 only (25 and 40 are not in every run).
  EXPECT_EQ(gap.noise.records, 3);
  EXPECT_EQ(gap.noise.first_step, 10);
  EXPECT_EQ(gap.noise.last_step, 30);
  EXPECT_NEAR(gap.noise.mean_absolute, (0.2 + 0.1 + 0.1) / 3, 1e-12);
  EXPECT_NEAR(gap.noise.mean_signed, (0.2 - 0.1 + 0.1) / 3, 1e-12);
  EXPECT_NEAR(gap.gap.mean_absolute, 0.05, 1e-12);
  EXPECT_NEAR(gap.gap.mean_signed, (0.05 + 0.05 - 0.05) / 3, 1e-12);
  EXPECT_NEAR(gap.ratio, 0.05 / (0.4 / 3), 1e-12);
  ASSERT_TRUE(gap.validation.has_value());
  EXPECT_EQ(gap.validation->step, 30);
  EXPECT_DOUBLE_EQ(gap.validation->candidate, 2.0);
  EXPECT_DOUBLE_EQ(gap.validation->second_baseline, 2.2);

  const plot::LossGap late = plot::measure_loss_gap(base, second, cand, 20);
  EXPECT_EQ(late.gap.records, 2);
  EXPECT_NEAR(late.noise.mean_absolute, 0.1, 1e-12);
  const std::string text = plot::describe_loss_gap(gap, base, second, cand);
  EXPECT_NE(text.find("of cand against base"), std::string::npos) << text;
  EXPECT_NE(text.find("0.37x the noise floor"), std::string::npos) << text;
}

TEST(LossGap, ACandidateWithoutALossWhereTheBaselineTrainedDiverged) {
  const RunMetrics base = metrics("base", {{10, "3.0"}, {20, "null"}, {30, "2.0"}});
  const RunMetrics second = metrics("second", {{10, "3.1"}, {20, "2.4"}, {30, "2.1"}});
  // A window the baseline itself skipped (step 20) is left out, not held against anyone.
  EXPECT_EQ(plot::measure_loss_gap(base, second, metrics("ok", {{10, "3.0"}, {20, "null"}, {30, "2.0"}})).gap.records, 2);
  const std::string error =
      test::error_of([&] { plot::measure_loss_gap(base, second, metrics("cand", {{10, "3.0"}, {20, "2.0"}, {30, "null"}})); });
  EXPECT_NE(error.find("cand: no finite loss at step 30 where base has 2.0000: the candidate diverged"), std::string::npos)
      << error;
  const std::string apart =
      test::error_of([&] { plot::measure_loss_gap(base, second, metrics("cand", {{15, "3.0"}})); });
  EXPECT_NE(apart.find("share no train record at a step >= 0"), std::string::npos) << apart;
}

// A small model of configs/default.toml that trains 30 steps in a few seconds on the CPU.
const std::string kSmall =
    " --set model.layers=2 --set model.hidden=64 --set model.heads=4 --set model.kv_heads=2 --set model.head_dim=16"
    " --set model.max_seq_len=128 --set train.micro_batch_tokens=1024 --set train.steps=30 --set train.eval_every=15"
    " --set train.sample_every=0 --set train.sample_tokens=0 --set checkpoint.every=0 --set log.every=5"
    " --set train.threads=2 --set train.device=cpu --set log.tensorboard=false --set log.plot=false";

std::string loss_gap(const std::string& args, int* code) {
  std::string output;
  *code = test::run_command(test::kiln_binary() + " loss-gap " + args + " 2>&1", &output);
  return output;
}

TEST(LossGap, TrainsThreeRunsAndFailsACandidateOutsideTheNoise) {
  const std::string dir = test::temp_dir("kiln-loss-gap") + "/gap";
  const std::string config = test::source_dir() + "/configs/default.toml";
  int code = 0;
  // A learning rate 1000x lower barely trains: its loss stays far above both seeds'.
  std::string out = loss_gap(config + kSmall + " --out " + dir + " --candidate optim.lr=1e-6 --seeds 7,8", &code);
  EXPECT_EQ(code, 1) << out;
  EXPECT_NE(out.find("loss-gap: training baseline-seed7 ..."), std::string::npos) << out;
  EXPECT_NE(out.find("the candidate changes the loss more than a seed does"), std::string::npos) << out;
  for (const char* run : {"baseline-seed7", "baseline-seed8", "candidate-seed7"}) {
    EXPECT_TRUE(fs::exists(fs::path(dir) / run / "metrics.jsonl")) << run;
    EXPECT_TRUE(fs::exists(fs::path(dir) / (std::string(run) + ".log"))) << run;
  }
  const nlohmann::json j = nlohmann::json::parse(test::read_file(dir + "/loss_gap.json"));
  EXPECT_EQ(j["inside_noise"], false);
  EXPECT_GT(j["ratio"].get<double>(), 1.5);
  EXPECT_GT(j["gap"]["mean_signed"].get<double>(), 0) << "the candidate trains worse";
  EXPECT_EQ(j["gap"]["last_step"], 30);
  EXPECT_EQ(j["validation"]["step"], 30);
  // The two seeds really train differently (the noise floor is not zero by construction).
  const std::vector<double> base = test::train_losses(dir + "/baseline-seed7");
  const std::vector<double> second = test::train_losses(dir + "/baseline-seed8");
  ASSERT_EQ(base.size(), second.size());
  ASSERT_FALSE(base.empty());
  EXPECT_NE(base[0], second[0]);

  // The same runs compared again, the second seed as the candidate: a gap of exactly the
  // noise (ratio 1) is inside; under --max-ratio 0.5 it is not.
  out = loss_gap("--runs " + dir + "/baseline-seed7 " + dir + "/baseline-seed8 " + dir + "/baseline-seed8", &code);
  EXPECT_EQ(code, 0) << out;
  EXPECT_NE(out.find("1.00x the noise floor"), std::string::npos) << out;
  EXPECT_NE(out.find("loss-gap: inside run-to-run noise"), std::string::npos) << out;
  out = loss_gap("--runs " + dir + "/baseline-seed7 " + dir + "/baseline-seed8 " + dir + "/baseline-seed8 --max-ratio 0.5",
                 &code);
  EXPECT_EQ(code, 1) << out;
  EXPECT_NE(out.find("over --max-ratio 0.5"), std::string::npos) << out;
}

TEST(LossGap, RefusesBadInputBeforeTrainingAnything) {
  const std::string base = test::temp_dir("kiln-loss-gap-refusals");
  const std::string config = test::source_dir() + "/configs/default.toml";
  const auto refused = [&](const std::string& args, const std::string& expected) {
    int code = 0;
    const std::string out = loss_gap(args, &code);
    EXPECT_EQ(code, 1) << args << "\n" << out;
    EXPECT_NE(out.find(expected), std::string::npos) << args << "\n" << out;
    EXPECT_EQ(out.find("training baseline"), std::string::npos) << "nothing is trained\n" << out;
  };
  refused(config + " --out " + base + "/a --candidate optim.lr", "--candidate optim.lr: expected KEY=VALUE");
  refused(config + " --out " + base + "/a --candidate train.seed=3", "loss-gap sets train.seed for each run itself");
  refused(config + " --out " + base + "/a --candidate optim.no_such_key=1", "optim.no_such_key");
  refused(config + " --out " + base + "/a --candidate optim.lr=1e-3 --seeds 5,5", "the two baselines need different seeds");
  refused(config + " --candidate optim.lr=1e-3", "--out DIR");
  refused(config + " --out " + base + "/a", "--candidate KEY=VALUE");
  EXPECT_FALSE(fs::exists(base + "/a")) << "no directory is made for a refused command";
  test::write_file(base + "/taken/keep.txt", "an earlier run");
  refused(config + " --out " + base + "/taken --candidate optim.lr=1e-3", "exists and is not empty");
  EXPECT_EQ(test::read_file(base + "/taken/keep.txt"), "an earlier run");
  refused("--runs " + base + "/x " + base + "/y " + base + "/z", "no such run directory");
  refused(config + " --runs a b c", "--runs compares finished runs");
}

}  // namespace
}  // namespace kiln

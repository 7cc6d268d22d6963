// The same config trains on either backend: 200 steps on the bundled corpus on the GPU
// follow the CPU's loss curve (both fp32, so the curves differ only by summation order).
#include "gpu/gpu_harness.h"
#include "test_util.h"
#include "train/trainer.h"

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>

namespace kiln {
namespace {

using namespace gpu_test;

std::vector<double> train_losses(const std::string& device, const std::string& out_dir) {
  std::vector<std::string> overrides = {
      "data.path=" + test::source_dir() + "/data/tinyshakespeare.txt", "train.out_dir=" + out_dir,
      "train.device=" + device, "model.hidden=64", "model.layers=2", "model.heads=4", "model.kv_heads=2",
      "model.head_dim=16", "model.ffn_hidden=128", "model.max_seq_len=128", "train.micro_batch_tokens=2048",
      "train.steps=200", "optim.warmup_steps=20", "optim.lr=3e-3", "train.eval_every=0", "train.eval_batches=2",
      "train.sample_every=0", "train.sample_tokens=8", "log.every=1", "train.threads=4", "checkpoint.save_final=false"};
  Trainer trainer(load_config("", overrides));
  trainer.run();
  std::vector<double> losses;
  std::ifstream in(out_dir + "/metrics.jsonl");
  std::string line;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    if (j["kind"] == "train") losses.push_back(j["loss"]);
  }
  return losses;
}

class Training : public GpuTest {};

TEST_F(Training, GpuFollowsTheCpuLossCurve) {
  const std::string dir = test::temp_dir("kiln-gpu-train");
  const auto cpu = train_losses("cpu", dir + "/cpu");
  const auto gpu = train_losses("cuda", dir + "/gpu");
  ASSERT_EQ(cpu.size(), 200u);
  ASSERT_EQ(gpu.size(), 200u);
  // Single steps can differ by a few hundredths where a spike lands differently (measured
  // 0.06 once); the curve, averaged over windows of 10 steps, must agree closely.
  double worst_step = 0, worst_window = 0;
  for (size_t i = 0; i < cpu.size(); ++i) worst_step = std::max(worst_step, std::fabs(cpu[i] - gpu[i]));
  for (size_t w = 0; w < cpu.size(); w += 10) {
    double c = 0, g = 0;
    for (size_t i = w; i < w + 10; ++i) c += cpu[i], g += gpu[i];
    worst_window = std::max(worst_window, std::fabs(c - g) / 10);
  }
  std::printf("cpu loss %.4f -> %.4f, gpu %.4f -> %.4f, largest difference: %.2e per step, %.2e per 10-step window\n",
              cpu.front(), cpu.back(), gpu.front(), gpu.back(), worst_step, worst_window);
  EXPECT_LT(std::fabs(cpu.front() - gpu.front()), 1e-4);
  EXPECT_LT(worst_step, 0.2);
  EXPECT_LT(worst_window, 0.03);
  EXPECT_LT(std::fabs(cpu.back() - gpu.back()), 0.02);
  EXPECT_LT(gpu.back(), 2.6);  // it learned (the CPU run reaches about 2.2)
  std::filesystem::remove_all(dir);
}

// Exact resume on the GPU: a run killed (SIGKILL) after its step-20 checkpoint and resumed
// logs the same losses, bit for bit, as a run that never stopped. Every GPU kernel of the
// training step sums in a fixed order (the embedding backward by token groups), so the
// GPU path is deterministic as it is.
TEST_F(Training, GpuResumeAfterKillIsBitwiseEqual) {
  const std::string dir = test::temp_dir("kiln-gpu-resume");
  test::write_file(dir + "/empty.toml", "");
  const std::string run = test::kiln_binary() + " train " + dir + "/empty.toml --set data.path=" + test::source_dir() +
                          "/data/tinyshakespeare.txt --set train.device=cuda --set model.hidden=64"
                          " --set model.layers=2 --set model.heads=4 --set model.kv_heads=2 --set model.head_dim=16"
                          " --set model.ffn_hidden=128 --set model.max_seq_len=128 --set train.micro_batch_tokens=2048"
                          " --set train.steps=30 --set checkpoint.every=10 --set log.every=1 --set train.eval_every=0"
                          " --set train.eval_batches=1 --set train.sample_every=0 --set train.sample_tokens=4"
                          " --set checkpoint.save_final=false --set train.out_dir=";
  std::string output;
  ASSERT_EQ(test::run_command(run + dir + "/straight", &output), 0) << output;
  EXPECT_NE(test::run_command("KILN_FAULT_INJECT=kill_at_step:26 " + run + dir + "/resumed", &output), 0) << output;
  ASSERT_EQ(test::run_command(run + dir + "/resumed --resume", &output), 0) << output;
  auto losses = [](const std::string& out_dir) {
    std::vector<double> out;
    std::ifstream in(out_dir + "/metrics.jsonl");
    std::string line;
    while (std::getline(in, line)) {
      const auto j = nlohmann::json::parse(line);
      if (j["kind"] == "train") out.push_back(j["loss"]);
    }
    return out;
  };
  const auto straight = losses(dir + "/straight"), resumed = losses(dir + "/resumed");
  ASSERT_EQ(straight.size(), 30u);
  EXPECT_EQ(resumed, straight);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kiln

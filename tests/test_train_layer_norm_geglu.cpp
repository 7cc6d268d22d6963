// Short CPU training runs with the LayerNorm, GeGLU, Gemma RMSNorm, DyT, GELU and ReLU^2
// components in place of RMSNorm and SwiGLU: on the bundled corpus the loss must fall from
// the uniform guess (ln 259 = 5.56 nats) well past the unigram plateau (~3.2) within 120
// steps, with every value finite.
// The finite-difference tests (test_modules_grad) say the gradients are right; these say
// the components also train (init, no decay on gains and biases, the optimizer's groups).
#include "test_util.h"
#include "train/trainer.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <numeric>

namespace kiln {
namespace {

std::vector<double> train_losses(const std::string& norm, const std::string& mlp, const std::string& out_dir,
                                 const std::string& qk_norm, const std::string& final_norm, double embed_scale) {
  const std::vector<std::string> overrides = {
      "data.path=" + test::source_dir() + "/data/tinyshakespeare.txt", "train.out_dir=" + out_dir,
      "train.device=cpu", "model.norm=" + norm, "model.mlp=" + mlp, "model.hidden=64", "model.layers=2",
      "model.heads=4", "model.kv_heads=2", "model.head_dim=16", "model.ffn_hidden=128", "model.max_seq_len=128",
      "train.micro_batch_tokens=1024", "train.steps=120", "optim.warmup_steps=10", "optim.lr=3e-3",
      "train.eval_every=0", "train.eval_batches=1", "train.sample_every=0", "train.sample_tokens=8", "log.every=1",
      "train.threads=2", "checkpoint.save_final=false", "model.qk_norm_type=" + qk_norm,
      "model.ungated_ffn_hidden=192", "model.final_norm=" + final_norm,
      "model.embed_scale=" + std::to_string(embed_scale)};
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

// The mean loss of the last 10 steps must fall below `below`.
void expect_learns(const std::string& norm, const std::string& mlp, const std::string& qk_norm, double below,
                   const std::string& final_norm = "", double embed_scale = 1.0) {
  const std::string dir = test::temp_dir("kiln-train-" + norm + "-" + mlp);
  const std::vector<double> losses = train_losses(norm, mlp, dir, qk_norm, final_norm, embed_scale);
  ASSERT_EQ(losses.size(), 120u);
  for (double l : losses) ASSERT_TRUE(std::isfinite(l));
  const double last10 = std::accumulate(losses.end() - 10, losses.end(), 0.0) / 10;
  std::printf("%s + %s: loss %.4f -> %.4f (mean of the last 10 steps)\n", norm.c_str(), mlp.c_str(), losses.front(),
              last10);
  EXPECT_GT(losses.front(), 5.0);  // a fresh model guesses about uniformly
  EXPECT_LT(last10, below);
  std::filesystem::remove_all(dir);
}

// Past the unigram plateau (~3.3 on these steps' batches): measured 2.86 and 2.89.
TEST(TrainComponents, LayerNormWithGegluLearns) { expect_learns("layernorm", "geglu", "rmsnorm", 3.1); }

TEST(TrainComponents, LayerNormWithoutBiasWithSwigluLearns) {
  expect_learns("layernorm_nobias", "swiglu", "rmsnorm", 3.1);
}

// Gemma's RMSNorm as the block norms and the q/k norm, with the ungated GELU MLP (width 192:
// the parameters of the gated runs' 128). Measured 2.50.
TEST(TrainComponents, GemmaRmsNormWithGeluLearns) { expect_learns("gemma_rmsnorm", "gelu", "gemma_rmsnorm", 3.1); }

// DyT as the block norms and the q/k norm, with relu2 and an RMSNorm before the LM head,
// learns past the plateau (measured 3.02).
TEST(TrainComponents, DytWithRelu2AndAnRmsNormBeforeTheHeadLearns) {
  expect_learns("dyt", "relu2", "dyt", 3.1, "rmsnorm");
}

// DyT everywhere, the norm before the head too. DyT does not rescale its input, so with
// the embedding at init_std 0.02 every norm passes on a signal about 1% of a norm's and
// the model sits at the unigram plateau (3.32 after 120 steps, any seed, alpha or lr).
// model.embed_scale = 2 / init_std = 100 (the embedding's output at RMS 2) lets it learn:
// measured 3.047 to 3.083 over 4 seeds (docs/dyt.md); the bound sits between those and
// the plateau.
TEST(TrainComponents, DytEverywhereWithAnEmbeddingAtUnitScaleLearns) {
  expect_learns("dyt", "relu2", "dyt", 3.15, "dyt", 100.0);
}

}  // namespace
}  // namespace kiln

// Run bookkeeping beyond steps: a token budget (train.tokens), validation and checkpoints
// every N tokens, periodic Hugging Face exports, and the real (non-PAD) token counts, the
// log window and the memory in the log, metrics.jsonl and summary.json.
#include "fault_test_util.h"

#include <fmt/format.h>

#include <filesystem>

using namespace kiln;
using namespace kiln::test;

namespace {

class Bookkeeping : public TinyRunTest {
 protected:
  Bookkeeping() : TinyRunTest("kiln_bookkeeping") {}
};

}  // namespace

// 2 micro-batches of 256 positions: 512 tokens a step.
TEST_F(Bookkeeping, ATokenBudgetSetsTheStepsAndTokenIntervalsTheirEvents) {
  const std::string out = dir_ + "/budget";
  std::string output;
  ASSERT_EQ(run_with_fault(tiny_train(corpus_, out,
                                      "--set train.tokens=4000 --set data.val_fraction=0.3 --set train.eval_batches=1"
                                      " --set train.eval_every_tokens=1500 --set checkpoint.every=0"
                                      " --set checkpoint.every_tokens=2048"),
                           "", &output),
            0)
      << output;
  EXPECT_CONTAINS(output, "train.tokens 4000: 8 steps of 512 tokens");  // ceil(4000 / 512)
  const auto summary = nlohmann::json::parse(read_file(out + "/summary.json"));
  EXPECT_EQ(summary["steps"], 8);
  EXPECT_EQ(summary["tokens"], 8 * 512);
  EXPECT_CONTAINS(read_file(out + "/config.toml"), "steps = 8");
  // 1500 tokens are crossed after steps 3 (1536), 6 (3072); the end validates too.
  EXPECT_EQ(steps_of(metrics_of_kind(out, "validation")), (std::vector<int64_t>{3, 6, 8}));
  // 2048 after step 4; the end (8, 4096) saves the final checkpoint either way.
  EXPECT_EQ(steps_of(metrics_of_kind(out, "checkpoint")), (std::vector<int64_t>{4, 8}));
}

// 512 tokens a step, 12 steps: each action every N tokens instead of every N steps.
TEST_F(Bookkeeping, LogSampleEvalAndExportRunEveryNTokens) {
  const std::string out = dir_ + "/token-cadences";
  std::string output;
  ASSERT_EQ(run_with_fault(tiny_train(corpus_, out,
                                      "--set log.every=0 --set log.every_tokens=1024"
                                      " --set train.sample_tokens=4 --set train.sample_every_tokens=1536"
                                      " --set eval.texts=" KILN_SOURCE_DIR "/data/eval/shakespeare_held_out.txt"
                                      " --set eval.limit=2 --set eval.every_tokens=2048"
                                      " --set checkpoint.every=0 --set checkpoint.export_hf_every_tokens=3072"),
                           "", &output),
            0)
      << output;
  // 1024 is crossed every 2 steps; the log runs after the last step too.
  EXPECT_EQ(steps_of(metrics_of_kind(out, "train")), (std::vector<int64_t>{2, 4, 6, 8, 10, 12}));
  // 1536: steps 3, 6, 9; the end of the run samples and evaluates (12) either way.
  EXPECT_EQ(steps_of(metrics_of_kind(out, "sample")), (std::vector<int64_t>{3, 6, 9, 12}));
  EXPECT_EQ(steps_of(metrics_of_kind(out, "eval")), (std::vector<int64_t>{4, 8, 12}));
  // 3072 after step 6 and the last, 12, which the end of the run exports after its save.
  EXPECT_CONTAINS(output, "export: step 6 as Qwen3ForCausalLM");
  EXPECT_CONTAINS(output, "export: step 12 as Qwen3ForCausalLM");
  EXPECT_FALSE(std::filesystem::exists(out + "/hf/step-4"));
}

TEST_F(Bookkeeping, AStepsAndATokensCadenceForOneActionAreRefused) {
  std::string output;
  EXPECT_EQ(run_with_fault(tiny_train(corpus_, dir_ + "/both", "--set log.every_tokens=1024"), "", &output), 1)
      << output;  // tiny_train gives log.every=1
  EXPECT_CONTAINS(output, "kiln: error: [config] log.every (1) and log.every_tokens (1024) are mutually exclusive");
}

TEST_F(Bookkeeping, RealTokensLeavePadOutAndAddUp) {
  const std::string out = dir_ + "/real";
  std::string output;
  ASSERT_EQ(run_with_fault(tiny_train(corpus_, out, "--set log.every=3"), "", &output), 0) << output;
  const auto records = metrics_of_kind(out, "train");
  ASSERT_EQ(records.size(), 4u);  // steps 3, 6, 9, 12
  int64_t documents = 0;
  for (const auto& r : records) {
    EXPECT_GT(r["document_tokens"].get<int64_t>(), 0);
    EXPECT_LE(r["document_tokens"].get<int64_t>(), r["tokens"].get<int64_t>());
    EXPECT_GE(r["document_tokens"].get<int64_t>(), r["target_tokens"].get<int64_t>());
    documents += r["document_tokens"].get<int64_t>();
    // The window each record averages over, and the process's memory; no MFU on the CPU
    // (no known peak), nor GPU memory.
    EXPECT_EQ(r["window_steps"], 3);
    EXPECT_GT(r["host_peak_rss_bytes"].get<int64_t>(), 1 << 20);
    EXPECT_FALSE(r.contains("mfu"));
    EXPECT_FALSE(r.contains("device_memory_used_bytes"));
  }
  const auto summary = nlohmann::json::parse(read_file(out + "/summary.json"));
  EXPECT_EQ(summary["document_tokens"].get<int64_t>(), documents);
  EXPECT_GT(summary["document_tokens_per_second"].get<double>(), 0);
  EXPECT_LE(summary["document_tokens_per_second"].get<double>(), summary["tokens_per_second"].get<double>());
  if (documents < summary["tokens"].get<int64_t>()) EXPECT_CONTAINS(output, " real) |");
}

TEST_F(Bookkeeping, PeriodicHuggingFaceExportsAreStockModels) {
  const std::string out = dir_ + "/export";
  std::string output;
  ASSERT_EQ(run_with_fault(tiny_train(corpus_, out, "--set checkpoint.export_hf_every=6 --set checkpoint.every=0"), "",
                           &output),
            0)
      << output;
  for (int step : {6, 12}) {
    const std::string hf = fmt::format("{}/hf/step-{}", out, step);
    EXPECT_CONTAINS(output, fmt::format("export: step {} as Qwen3ForCausalLM", step));
    const auto config = nlohmann::json::parse(read_file(hf + "/config.json"));
    EXPECT_EQ(config["model_type"], "qwen3");
    EXPECT_TRUE(std::filesystem::exists(hf + "/model.safetensors"));
    // A stock model: kiln's importer, which checks config.json and every tensor's name and
    // shape as transformers lays them out, takes it back.
    std::string imported;
    ASSERT_EQ(run_command(kiln_binary() + " import hf " + hf + " " + dir_ + fmt::format("/imported-{}", step), &imported),
              0)
        << imported;
  }
  EXPECT_FALSE(std::filesystem::exists(out + "/hf/step-3"));
}

TEST_F(Bookkeeping, APeriodicExportOfAModelWithNoStockClassIsRefusedAtStart) {
  std::string output;
  EXPECT_EQ(run_with_fault(tiny_train(corpus_, dir_ + "/refused",
                                      "--set checkpoint.export_hf_every=6 --set model.norm=dyt"),
                           "", &output),
            1)
      << output;
  EXPECT_CONTAINS(output, "kiln: error: [export] model.norm = 'dyt': no stock Hugging Face or llama.cpp family has "
                          "Dynamic Tanh norms");
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/refused/metrics.jsonl"));
}

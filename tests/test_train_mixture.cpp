// A real `kiln train` on configs/examples/mixture.toml (its JSONL made from the bundled
// text as the example says): per-source validation losses, and a run killed mid-way
// that resumes bitwise.
#include "fault_test_util.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

namespace kiln {
namespace {

namespace fs = std::filesystem;

// The example config, with its paths pointed at `dir`: the bundled text file and a JSONL
// of its documents (what the example's python line writes).
std::string example_config(const std::string& dir) {
  const std::string text = test::read_file(KILN_SOURCE_DIR "/data/tinyshakespeare.txt");
  std::string jsonl;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find("\n\n", start);
    if (end == std::string::npos) end = text.size();
    std::string doc = text.substr(start, end - start);
    start = end + 2;
    if (doc.find_first_not_of(" \n") == std::string::npos) continue;
    std::string escaped;
    for (const char c : doc) escaped += c == '\n' ? std::string("\\n") : c == '"' ? std::string("\\\"") : std::string(1, c);
    jsonl += "{\"text\": \"" + escaped + "\"}\n";
  }
  test::write_file(dir + "/tinyshakespeare.jsonl", jsonl);
  std::string config = test::read_file(KILN_SOURCE_DIR "/configs/examples/mixture.toml");
  const auto replace = [&](const std::string& from, const std::string& to) {
    const size_t at = config.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    if (at != std::string::npos) config.replace(at, from.size(), to);
  };
  replace("\"../../data/tinyshakespeare.txt\"", "\"" KILN_SOURCE_DIR "/data/tinyshakespeare.txt\"");
  replace("\"../../data/tinyshakespeare.jsonl\"", "\"tinyshakespeare.jsonl\"");
  test::write_file(dir + "/mixture.toml", config);
  return dir + "/mixture.toml";
}

std::string tiny(const std::string& config, const std::string& out_dir, const std::string& extra = "") {
  return test::kiln_binary() + " train " + config + " --set train.out_dir=" + out_dir +
         " --set model.hidden=32 --set model.layers=1 --set model.heads=2 --set model.kv_heads=1"
         " --set model.head_dim=16 --set model.ffn_hidden=64 --set model.max_seq_len=64"
         " --set train.micro_batch_tokens=256 --set train.steps=8 --set optim.warmup_steps=2"
         " --set train.eval_every=4 --set train.eval_batches=3 --set train.sample_every=0"
         " --set train.sample_tokens=0 --set log.every=1 --set train.threads=2 --set data.prefetch=2"
         " --set checkpoint.every=4 --set checkpoint.keep_last=0 --set log.plot=false " + extra + " 2>&1";
}

TEST(TrainMixture, TheExampleConfigTrainsAndAKilledRunResumesBitwise) {
  const std::string dir = test::temp_dir("kiln-train-mixture");
  const std::string config = example_config(dir);
  std::string output;
  ASSERT_EQ(test::run_command(tiny(config, dir + "/straight"), &output), 0) << output;
  EXPECT_NE(output.find("data mixture fineweb-edu 80% cosmopedia 20%"), std::string::npos) << output;
  EXPECT_EQ(test::metrics_of_kind(dir + "/straight", "validation").size(), 2u) << output;
  // A loss per source besides the union's (3 batches: fineweb-edu, fineweb-edu, cosmopedia).
  const auto per_source = test::metrics_of_kind(dir + "/straight", "validation_sources");
  ASSERT_EQ(per_source.size(), 2u) << output;
  EXPECT_TRUE(per_source[0].contains("fineweb-edu") && per_source[0].contains("cosmopedia")) << per_source[0].dump();
  EXPECT_NE(output.find("per source: fineweb-edu "), std::string::npos) << output;
  // The saved config keeps the sources and loads back.
  const std::string saved = test::read_file(dir + "/straight/config.toml");
  EXPECT_NE(saved.find("[[data.sources]]"), std::string::npos) << saved;
  // Killed at step 6 after the checkpoint at 4, then resumed: the same steps bitwise.
  ASSERT_EQ(test::run_with_fault(tiny(config, dir + "/killed"), "kill_at_step:6", &output), -SIGKILL) << output;
  ASSERT_EQ(test::run_with_fault(tiny(config, dir + "/killed", "--resume"), "", &output), 0) << output;
  EXPECT_NE(output.find("resumed from"), std::string::npos) << output;
  const auto a = test::train_records(dir + "/straight"), b = test::train_records(dir + "/killed");
  ASSERT_EQ(a.size(), 8u);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i], b[i]) << "step " << a[i].step;
  // And from the run directory alone (its saved config).
  ASSERT_EQ(test::run_command(test::kiln_binary() + " train " + dir + "/killed --resume --set train.steps=9 2>&1",
                              &output), 0) << output;
  if (!HasFailure()) fs::remove_all(dir);
}

}  // namespace
}  // namespace kiln

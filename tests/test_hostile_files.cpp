// Files that are no file of their kind, through the real binary: a FIFO, a device, a file
// far too large, a wrongly typed JSON value, an eval example too long for the model. Each
// is refused with one line naming the file (and the line or field), before training or any
// write (they used to hang, read without end, die of std::bad_alloc or type_error naming
// nothing, or fail after the last step as a warning).
#include "fault_test_util.h"

#include <sys/stat.h>

namespace kiln {
namespace {

namespace fs = std::filesystem;

class HostileFiles : public test::TinyRunTest {
 protected:
  HostileFiles() : test::TinyRunTest("kiln-hostile", 20) {}
  std::string train(const std::string& extra) { return test::tiny_train(corpus_, dir_ + "/run", extra); }
  // A fresh DIR/hf holding `config_json` as config.json; returns the `kiln import hf`
  // command line that reads it (under `timeout`: a hang must fail, not stall the suite).
  std::string import_hf(const std::string& config_json) {
    fs::remove_all(dir_ + "/hf");
    test::write_file(dir_ + "/hf/config.json", config_json);
    return "timeout 30 " + test::kiln_binary() + " import hf " + dir_ + "/hf " + dir_ + "/imported";
  }
  void make_fifo(const std::string& path) { ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0) << path; }
};

std::string qwen3_moe_config(const std::string& num_experts) {
  return R"({"model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 1,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "intermediate_size": 64,
    "max_position_embeddings": 64, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "num_experts": )" +
         num_experts + "}";
}

TEST_F(HostileFiles, ImportHfRefusesHugeCountsByFileAndKey) {
  // 2^31 experts grew past 5 GB before anything was said.
  const std::string line = test::one_line_error(import_hf(qwen3_moe_config("2147483648")), 5);
  EXPECT_CONTAINS(line, "kiln: error: [import] " + dir_ + "/hf/config.json: the model it describes is refused: "
                        "[config] model.moe.experts must be <= 4096");
  EXPECT_FALSE(fs::exists(dir_ + "/imported"));
}

TEST_F(HostileFiles, ImportHfRefusesFilesThatAreNoRegularFilesOrTooLarge) {
  const std::string hf = dir_ + "/hf";
  const std::string valid = qwen3_moe_config("4");
  // config.json: a FIFO hung nothing (no writer: open waits), /dev/zero was read past 4 GB.
  std::string command = import_hf(valid);
  fs::remove(hf + "/config.json");
  make_fifo(hf + "/config.json");
  EXPECT_CONTAINS(test::one_line_error(command, 5),
                  "kiln: error: [import] " + hf + "/config.json: is a FIFO, not a JSON file");
  command = import_hf(valid);
  fs::remove(hf + "/config.json");
  fs::create_symlink("/dev/zero", hf + "/config.json");
  EXPECT_CONTAINS(test::one_line_error(command, 5),
                  "kiln: error: [import] " + hf + "/config.json: is a character device, not a JSON file");
  command = import_hf(valid);
  fs::resize_file(hf + "/config.json", (size_t{256} << 20) + 1);  // sparse: no disk used
  EXPECT_CONTAINS(test::one_line_error(command, 10),
                  "kiln: error: [import] " + hf + "/config.json: larger than 268435456 bytes: not a JSON file");

  command = import_hf(valid);
  fs::create_symlink("/dev/zero", hf + "/tokenizer.json");
  EXPECT_CONTAINS(test::one_line_error(command, 5),
                  "kiln: error: [import] " + hf + "/tokenizer.json: is a character device, not a JSON file");
  command = import_hf(valid);
  make_fifo(hf + "/model.safetensors.index.json");
  EXPECT_CONTAINS(test::one_line_error(command, 5),
                  "kiln: error: [import] " + hf + "/model.safetensors.index.json: is a FIFO, not a JSON file");
  // A FIFO as the weights hung `kiln import hf` in open().
  command = import_hf(valid);
  make_fifo(hf + "/model.safetensors");
  EXPECT_CONTAINS(test::one_line_error(command, 5),
                  "kiln: error: [safetensors] " + hf + "/model.safetensors: is a FIFO, not a safetensors file");
  // A shard name that is not a string was "internal error: [json.exception.type_error.302]".
  command = import_hf(valid);
  test::write_file(hf + "/model.safetensors.index.json", R"({"weight_map": {"lm_head.weight": 3}})");
  EXPECT_CONTAINS(test::one_line_error(command, 5),
                  "kiln: error: [import] " + hf +
                      "/model.safetensors.index.json: weight_map['lm_head.weight'] must be a string, got number 3");
  EXPECT_FALSE(fs::exists(dir_ + "/imported"));
  // Shard names that are not files of the directory (the fuzzer found "." accepted).
  for (const std::string name : {".", "..", "../model.safetensors", "sub/model.safetensors", ""}) {
    test::write_file(hf + "/model.safetensors.index.json",
                     R"({"weight_map": {"lm_head.weight": ")" + name + R"("}})");
    EXPECT_CONTAINS(test::one_line_error(command, 5),
                    "kiln: error: [import] " + hf + "/model.safetensors.index.json: shard name '" + name +
                        "' is not a file of the model's directory");
    EXPECT_FALSE(fs::exists(dir_ + "/imported"));
  }
}

TEST_F(HostileFiles, EvalFilesThatAreNoRegularFilesAreRefusedBeforeTraining) {
  // /dev/zero as an eval text was read past 4 GB (std::bad_alloc).
  EXPECT_CONTAINS(test::one_line_error("timeout 30 " + train("--set eval.texts=/dev/zero"), 5),
                  "kiln: error: [eval] /dev/zero: is a character device, not a text file");
  const std::string fifo = dir_ + "/tasks.jsonl";
  make_fifo(fifo);
  EXPECT_CONTAINS(test::one_line_error("timeout 30 " + train("--set eval.tasks=" + fifo), 5),
                  "kiln: error: [eval] " + fifo + ": is a FIFO, not a task file (JSONL)");
  EXPECT_TRUE(test::train_records(dir_ + "/run").empty()) << "a refused run trained";
}

// A choice of 100000 tokens named no file or line, and in [eval] it failed only after the
// last step, as a warning, with exit code 0.
TEST_F(HostileFiles, AnEvalChoiceTooLongForTheContextIsRefusedAtStartNamingTheLine) {
  const std::string tasks = dir_ + "/long.jsonl";
  test::write_file(tasks, R"({"context": "Q:", "choices": [" a", " b"], "answer": 0})"
                          "\n"
                          R"({"context": "Q:", "choices": [" a", ")" +
                              std::string(100000, 'x') + R"("], "answer": 0})"
                                                         "\n");
  EXPECT_CONTAINS(test::one_line_error(train("--set eval.tasks=" + tasks), 10),
                  "kiln: error: [eval] " + tasks + ":2: choice 1 has 100000 tokens; at most 63 fit the model's "
                  "context of 64");
  EXPECT_TRUE(test::train_records(dir_ + "/run").empty()) << "a refused run trained";
}

// A diverged model's validation loss (NaN) was reported as "no validation loss".
TEST_F(HostileFiles, ANaNValidationLossIsReportedAsNaN) {
  std::string output;
  EXPECT_EQ(test::run_with_fault(train("--set data.val_fraction=0.3 --set train.eval_batches=1"),
                                 "nan_validation:all", &output),
            0)
      << output;
  EXPECT_CONTAINS(test::last_line(output), "| validation loss nan");
  EXPECT_CONTAINS(output, "validation at step 12: loss nan");
}

}  // namespace
}  // namespace kiln

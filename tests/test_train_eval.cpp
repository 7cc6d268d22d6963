// [eval] during training: the suite runs every eval.every steps and at the end on the
// model being trained, its numbers equal to `kiln eval` on the checkpoint of that step,
// recorded in the log and metrics.jsonl; a bad task file stops the run before any step;
// a resumed run's records read as one run.
#include "fault_test_util.h"

#include <fmt/format.h>

#include <filesystem>

using namespace kiln;
using namespace kiln::test;

namespace {

class TrainEval : public TinyRunTest {
 protected:
  TrainEval() : TinyRunTest("kiln_train_eval") {}
  void SetUp() override {
    TinyRunTest::SetUp();
    task_ = dir_ + "/cloze.jsonl";
    write_file(task_, R"({"context": "the king", "choices": [" of night", " sword river", " and"], "answer": 0})" "\n"
                      R"({"context": "a crown of", "choices": [" stone.", " the wind speaks", " fire"], "answer": 2})" "\n"
                      R"({"context": "", "choices": ["old light", "river"], "answer": 1})" "\n");
    text_ = dir_ + "/held_out.txt";
    write_file(text_, "the old king speaks to the river and the wind of night.");
  }
  std::string eval_keys() const {
    return fmt::format(" --set eval.tasks={} --set eval.texts={} --set eval.every=4", task_, text_);
  }
  std::string task_, text_;
};

}  // namespace

TEST_F(TrainEval, EvaluatesEveryNStepsAndAtTheEndAsKilnEvalDoes) {
  const std::string out = dir_ + "/run";
  std::string output;
  ASSERT_EQ(run_with_fault(tiny_train(corpus_, out, "--set train.steps=10" + eval_keys()), "", &output), 0) << output;
  EXPECT_CONTAINS(output, "evaluation at step 4");
  EXPECT_CONTAINS(output, "evaluation at step 8");
  EXPECT_CONTAINS(output, "evaluation at step 10");
  const auto records = metrics_of_kind(out, "eval");
  ASSERT_EQ(steps_of(records), (std::vector<int64_t>{4, 8, 10}));
  for (const char* tag : {"cloze/acc", "cloze/acc_norm", "held_out/token_perplexity",
                          "held_out/word_perplexity", "held_out/bits_per_byte"})
    EXPECT_TRUE(records.back().contains(tag)) << tag << " " << records.back().dump();
  // The run's last evaluation is `kiln eval` of the saved model (the final weights).
  const std::string json = dir_ + "/eval.json";
  ASSERT_EQ(run_command(kiln_binary() + " eval " + out + "/model --device cpu --task " + task_ + " --text " + text_ +
                            " --json " + json,
                        &output),
            0)
      << output;
  const auto mine = nlohmann::json::parse(read_file(json));
  const auto& last = records.back();
  EXPECT_DOUBLE_EQ(last["cloze/acc"].get<double>(), mine["tasks"]["cloze"]["acc"].get<double>());
  EXPECT_DOUBLE_EQ(last["cloze/acc_norm"].get<double>(), mine["tasks"]["cloze"]["acc_norm"].get<double>());
  EXPECT_NEAR(last["held_out/bits_per_byte"].get<double>(),
              mine["texts"]["held_out"]["bits_per_byte"].get<double>(), 1e-6);
}

TEST_F(TrainEval, ABadTaskFileStopsTheRunBeforeAnyStep) {
  write_file(task_, "{\"context\": \"a\", \"choices\": [\"x\", \"y\"], \"answer\": 5}\n");
  const std::string out = dir_ + "/bad";
  std::string output;
  EXPECT_EQ(run_with_fault(tiny_train(corpus_, out, eval_keys()), "", &output), 1) << output;
  EXPECT_CONTAINS(output, task_ + ":1: 'answer' 5 is not the index");
  EXPECT_FALSE(std::filesystem::exists(out + "/metrics.jsonl"));
}

TEST_F(TrainEval, AResumedRunKeepsOneRecordPerEvaluation) {
  const std::string out = dir_ + "/resumed";
  std::string output;
  // Killed at the start of step 7 (after the evaluation of step 4 and the checkpoint of step
  // 4 saved; step 6 logged), then resumed from step 4 to the end.
  EXPECT_NE(run_with_fault(tiny_train(corpus_, out, eval_keys()), "kill_at_step:7", &output), 0) << output;
  ASSERT_EQ(run_with_fault(tiny_train(corpus_, out, eval_keys() + " --resume"), "", &output), 0) << output;
  EXPECT_EQ(steps_of(metrics_of_kind(out, "eval")), (std::vector<int64_t>{4, 8, 12}));
}

// The end of a training run, through the real binary: after the last step the model and
// the final checkpoint are saved first, then the run validates and samples. So a SIGTERM or
// SIGINT during that end-of-run work stops it at once and exits 0 with everything on disk,
// a failing validation or sample is a warning that undoes nothing, and the run's samples
// are those of `kiln sample` (one sampling path, through the KV-cache Generator).
#include "fault_test_util.h"

#include "train/checkpoint.h"

#include <chrono>
#include <thread>

namespace kiln {
namespace {

namespace fs = std::filesystem;
using test::run_with_fault;
using test::tiny_train;

// Validation (a fifth of 200 documents, 8 micro-batches) and a 30-token sample at the end.
constexpr const char* kEndOfRun =
    "--set data.val_fraction=0.2 --set train.eval_batches=8 --set train.sample_tokens=30 ";

class RunEnd : public test::TinyRunTest {
 protected:
  RunEnd() : test::TinyRunTest("kiln-run-end", 200) {}
  // The model and the final checkpoint of a 12-step run are there and whole.
  void expect_saved(const std::string& out) {
    EXPECT_TRUE(fs::exists(out + "/model/model.safetensors"));
    EXPECT_TRUE(fs::exists(out + "/model/config.toml"));
    EXPECT_EQ(test::latest_of(out), "step-00000012");
    EXPECT_NO_THROW(read_checkpoint(test::checkpoint_path(out, 12)));
  }
  // Starts the run with the end-of-run work slowed down (`delay_ms` per validation batch and
  // per sampled token), waits until `ready` says it is where the signal must land, signals
  // it and returns its exit code; its output in *output.
  int signal_during(int signal, int delay_ms, const std::function<bool(const std::string& out)>& ready,
                    const std::string& out, std::string* output) {
    const std::string log = out + ".log";
    const pid_t pid = test::spawn(fmt::format("env KILN_FAULT_INJECT=eval_delay_ms:{} ", delay_ms) +
                                      tiny_train(corpus_, out, kEndOfRun),
                                  log);
    EXPECT_GT(pid, 0);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
    while (!ready(out) && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    EXPECT_TRUE(ready(out)) << "never got there:\n" << test::read_file(log);
    EXPECT_EQ(kill(pid, signal), 0);
    int status = 0;
    EXPECT_EQ(waitpid(pid, &status, 0), pid);
    *output = test::read_file(log);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
  }
};

TEST_F(RunEnd, TheModelAndTheFinalCheckpointAreSavedBeforeTheFinalValidationAndSample) {
  const std::string out = dir_ + "/run";
  std::string output;
  ASSERT_EQ(run_with_fault(tiny_train(corpus_, out, kEndOfRun), "", &output), 0) << output;
  expect_saved(out);
  const size_t model = output.find("saved model to"), checkpoint = output.find("checkpoint: step 12 saved"),
               validation = output.find("validation at step 12"), sample = output.find("sample at step 12");
  ASSERT_NE(model, std::string::npos) << output;
  ASSERT_NE(checkpoint, std::string::npos) << output;
  ASSERT_NE(validation, std::string::npos) << output;
  ASSERT_NE(sample, std::string::npos) << output;
  EXPECT_LT(model, validation) << output;
  EXPECT_LT(checkpoint, validation) << output;
  EXPECT_LT(validation, sample) << output;
  EXPECT_CONTAINS(test::last_line(output), "done: 12 steps");
  EXPECT_CONTAINS(test::last_line(output), "validation loss ");
}

TEST_F(RunEnd, SigtermDuringTheFinalValidationStopsItAndExitsZeroWithEverythingSaved) {
  const std::string out = dir_ + "/run";
  std::string output;
  // `latest` moves to step 12 at the end of the final save; the validation comes next and
  // takes 8 x 500 ms.
  const int code = signal_during(
      SIGTERM, 500, [](const std::string& o) { return test::latest_of(o) == "step-00000012"; }, out, &output);
  EXPECT_EQ(code, 0) << output;
  EXPECT_CONTAINS(output, "stopped by SIGTERM after the last step (12)");
  EXPECT_EQ(output.find("validation at step 12"), std::string::npos) << output;
  EXPECT_EQ(output.find("sample at step 12"), std::string::npos) << output;
  EXPECT_EQ(output.find("done:"), std::string::npos) << output;
  expect_saved(out);
}

TEST_F(RunEnd, SigintDuringTheFinalSampleStopsItAndExitsZeroWithEverythingSaved) {
  const std::string out = dir_ + "/run";
  std::string output;
  // The validation is printed, then the sample takes 30 x 200 ms.
  const int code = signal_during(
      SIGINT, 200,
      [](const std::string& o) { return test::read_file(o + ".log").find("validation at step 12") != std::string::npos; },
      out, &output);
  EXPECT_EQ(code, 0) << output;
  EXPECT_CONTAINS(output, "validation at step 12");
  EXPECT_CONTAINS(output, "stopped by SIGINT after the last step (12)");
  EXPECT_EQ(output.find("sample at step 12"), std::string::npos) << output;
  expect_saved(out);
}

TEST_F(RunEnd, AFailingFinalValidationOrSampleIsAWarningAndUndoesNothing) {
  for (const char* what : {"validation", "sample"}) {
    SCOPED_TRACE(what);
    const std::string out = dir_ + "/" + what;
    std::string output;
    ASSERT_EQ(run_with_fault(tiny_train(corpus_, out, kEndOfRun), fmt::format("eval_error:{}", what), &output), 0)
        << output;
    EXPECT_CONTAINS(output, fmt::format("kiln: warning: [train] after the last step: [train] injected {} failure", what));
    EXPECT_CONTAINS(output, "the model and the final checkpoint were saved before it");
    expect_saved(out);
  }
}

TEST_F(RunEnd, ARunWithoutAValidationSetSaysSo) {
  const std::string out = dir_ + "/run";
  std::string output;
  ASSERT_EQ(run_with_fault(tiny_train(corpus_, out), "", &output), 0) << output;  // data.val_fraction=0
  EXPECT_CONTAINS(test::last_line(output), "| no validation set");
  EXPECT_EQ(output.find("nan"), std::string::npos) << output;
}

// One sampling path: the run's end-of-run sample is, token for token, what `kiln sample`
// draws from the saved model with the same prompt, settings and seed (train.seed + step).
TEST_F(RunEnd, TheRunsSampleIsWhatKilnSampleDrawsFromTheSavedModel) {
  const std::string out = dir_ + "/run";
  std::string output;
  ASSERT_EQ(run_with_fault(tiny_train(corpus_, out, kEndOfRun + std::string("--set train.sample_prompt=the")), "",
                           &output),
            0)
      << output;
  // The console has the raw bytes (metrics.jsonl replaces invalid UTF-8).
  const std::string header = "sample at step 12:\n";
  const size_t begin = output.find(header), end = output.find("\n---\n", begin);
  ASSERT_NE(end, std::string::npos) << output;
  const std::string sample = output.substr(begin + header.size(), end - begin - header.size());
  EXPECT_EQ(sample.rfind("the", 0), 0u) << sample;
  ASSERT_EQ(test::run_command(test::kiln_binary() + " sample " + out +
                                  "/model -p the -n 30 -t 0.8 -k 40 --seed 1349 --device cpu --threads 2",
                              &output),
            0)
      << output;
  EXPECT_EQ(output, sample + "\n");
}

}  // namespace
}  // namespace kiln

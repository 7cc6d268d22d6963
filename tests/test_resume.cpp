// Exact resume: N steps straight versus k steps, a crash or a signal, and a resume for
// the rest must give bitwise the same per-step losses, gradient norms, learning rates and
// final weights (CPU, fixed thread count). Plus the guards that refuse a resume which
// cannot be exact: another model, another precision, other data.
#include "fault_test_util.h"

#include "train/checkpoint.h"

#include <chrono>
#include <random>
#include <regex>
#include <thread>

namespace kiln {
namespace {

namespace fs = std::filesystem;
using test::run_with_fault;
using test::tiny_train;

class Resume : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = test::temp_dir("kiln-resume"); }
  void TearDown() override {
    if (!HasFailure()) fs::remove_all(dir_);
  }
  void expect_same_run(const std::string& a, const std::string& b, size_t steps = 12) {
    const auto ra = test::train_records(a), rb = test::train_records(b);
    EXPECT_EQ(ra.size(), steps);
    ASSERT_EQ(ra.size(), rb.size());
    for (size_t i = 0; i < ra.size(); ++i) EXPECT_EQ(ra[i], rb[i]) << "step " << ra[i].step << " differs";
    EXPECT_EQ(test::read_file(a + "/model/model.safetensors"), test::read_file(b + "/model/model.safetensors"))
        << "final weights differ";
  }
  std::string dir_;
};

TEST_F(Resume, KillInsideAGradientAccumulationRunResumesBitwise) {
  const std::string corpus = test::write_tiny_corpus(dir_, 40);
  const std::string straight = dir_ + "/straight", killed = dir_ + "/killed";
  std::string output;
  ASSERT_EQ(run_with_fault(tiny_train(corpus, straight), "", &output), 0) << output;
  // grad_accum = 2; checkpoint at 4; SIGKILL at the start of step 7, after steps 5 and 6
  // were logged: they are dropped from metrics.jsonl and run again.
  ASSERT_EQ(run_with_fault(tiny_train(corpus, killed), "kill_at_step:7", &output), -SIGKILL) << output;
  EXPECT_EQ(test::train_records(killed).size(), 6u);
  ASSERT_EQ(run_with_fault(tiny_train(corpus, killed, "--resume"), "", &output), 0) << output;
  EXPECT_CONTAINS(output, "resumed from " + test::checkpoint_path(killed, 4) + " at step 4");
  expect_same_run(straight, killed);
  EXPECT_EQ(test::read_file(test::checkpoint_path(straight, 12) + "/optimizer.safetensors"),
            test::read_file(test::checkpoint_path(killed, 12) + "/optimizer.safetensors"))
      << "final optimizer state differs";
  const auto resumes = test::metrics_of_kind(killed, "resume");
  ASSERT_EQ(resumes.size(), 1u);
  EXPECT_EQ(resumes[0]["step"], 4);
  // A checkpoint directory is also a model directory.
  ASSERT_EQ(test::run_command(test::kiln_binary() + " sample " + test::checkpoint_path(killed, 12) +
                                  " --prompt 'the' -n 8 --seed 1",
                              &output),
            0)
      << output;
}

// Muon for the matrices and AdamW for the rest: both groups' state (momentum buffers,
// moments) comes back bitwise.
TEST_F(Resume, MuonKillInsideAGradientAccumulationRunResumesBitwise) {
  const std::string corpus = test::write_tiny_corpus(dir_, 40);
  const std::string straight = dir_ + "/straight", killed = dir_ + "/killed";
  const std::string muon = "--set optim.name=muon";
  std::string output;
  ASSERT_EQ(run_with_fault(tiny_train(corpus, straight, muon), "", &output), 0) << output;
  EXPECT_CONTAINS(output, "optimizer: muon [matrix]: ");
  ASSERT_EQ(run_with_fault(tiny_train(corpus, killed, muon), "kill_at_step:7", &output), -SIGKILL) << output;
  ASSERT_EQ(run_with_fault(tiny_train(corpus, killed, muon + " --resume"), "", &output), 0) << output;
  expect_same_run(straight, killed);
  const std::string state = test::read_file(test::checkpoint_path(straight, 12) + "/optimizer.safetensors");
  EXPECT_EQ(state, test::read_file(test::checkpoint_path(killed, 12) + "/optimizer.safetensors"))
      << "final optimizer state differs";
  EXPECT_CONTAINS(state, "layers.0.attn.q_proj.weight.momentum_buffer");
  EXPECT_CONTAINS(state, "embed.weight.exp_avg_sq");
  // Another optimizer for the matrices cannot continue this state: refused by key.
  ASSERT_NE(run_with_fault(tiny_train(corpus, killed, "--resume --set train.steps=14"), "", &output), 0) << output;
  EXPECT_CONTAINS(output, "the run differs from the checkpoint in: optim.name ('muon' -> 'adamw')");
  ASSERT_NE(run_with_fault(tiny_train(corpus, killed, muon + " --resume --set optim.matrix.optimizer=adamw"), "", &output),
            0)
      << output;
  EXPECT_CONTAINS(output, "optim.matrix.optimizer ('auto' -> 'adamw')");
}

// QK-Clip with Muon, tau low enough to clip: the clipped weights come back bitwise (the
// step's logit maxima are per step, nothing of them to save).
TEST_F(Resume, QkClipKillInsideAGradientAccumulationRunResumesBitwise) {
  const std::string corpus = test::write_tiny_corpus(dir_, 40);
  const std::string straight = dir_ + "/straight", killed = dir_ + "/killed";
  const std::string clip = "--set optim.name=muon --set optim.qk_clip.enabled=true --set optim.qk_clip.tau=1.5";
  std::string output;
  ASSERT_EQ(run_with_fault(tiny_train(corpus, straight, clip), "", &output), 0) << output;
  EXPECT_TRUE(std::regex_search(output, std::regex("max logit [0-9.]+ clipped [1-9]"))) << output;
  ASSERT_EQ(run_with_fault(tiny_train(corpus, killed, clip), "kill_at_step:7", &output), -SIGKILL) << output;
  ASSERT_EQ(run_with_fault(tiny_train(corpus, killed, clip + " --resume"), "", &output), 0) << output;
  expect_same_run(straight, killed);
}

// Attention dropout (with the residual dropout): the masks are a function of the seed,
// step and micro-batch, so the resumed steps draw the masks the straight run drew. The
// run without it logs other losses: the trainer's key reaches the attention's masks.
TEST_F(Resume, AttentionDropoutKillResumesBitwise) {
  const std::string corpus = test::write_tiny_corpus(dir_, 40);
  const std::string straight = dir_ + "/straight", killed = dir_ + "/killed", plain = dir_ + "/plain";
  const std::string drop = "--set model.attention_dropout=0.3 --set model.dropout=0.1";
  std::string output;
  ASSERT_EQ(run_with_fault(tiny_train(corpus, straight, drop), "", &output), 0) << output;
  ASSERT_EQ(run_with_fault(tiny_train(corpus, killed, drop), "kill_at_step:7", &output), -SIGKILL) << output;
  ASSERT_EQ(run_with_fault(tiny_train(corpus, killed, drop + " --resume"), "", &output), 0) << output;
  expect_same_run(straight, killed);
  ASSERT_EQ(run_with_fault(tiny_train(corpus, plain, "--set model.dropout=0.1"), "", &output), 0) << output;
  const auto with = test::train_records(straight), without = test::train_records(plain);
  ASSERT_FALSE(with.empty());
  ASSERT_EQ(with.size(), without.size());
  EXPECT_NE(with[0].loss, without[0].loss) << "attention dropout left the first step's loss as it was";
}

// A restart with --resume of an attempt that died before its first checkpoint (a scheduler
// restarts every attempt so): its metrics.jsonl holds its own 12 steps once (not appended
// to the dead attempt's), and the dead attempt's records are in metrics.jsonl.previous,
// announced. (A fresh run into an earlier run's directory is refused: test_run_directory.)
TEST_F(Resume, ARestartWithoutACheckpointStartsANewMetricsFile) {
  const std::string corpus = test::write_tiny_corpus(dir_, 40);
  const std::string out = dir_ + "/run";
  std::string output;
  ASSERT_EQ(run_with_fault(tiny_train(corpus, out, "--set checkpoint.every=0"), "kill_at_step:3", &output), -SIGKILL)
      << output;
  const std::string first = test::read_file(out + "/metrics.jsonl");
  ASSERT_EQ(run_with_fault(tiny_train(corpus, out, "--set optim.lr=5e-3 --resume"), "", &output), 0) << output;
  EXPECT_CONTAINS(output, "metrics: " + out + "/metrics.jsonl held an earlier run's records: moved to " + out +
                              "/metrics.jsonl.previous");
  EXPECT_EQ(test::read_file(out + "/metrics.jsonl.previous"), first);
  const std::string second = test::read_file(out + "/metrics.jsonl");
  EXPECT_NE(second, first);
  size_t train_records = 0;
  for (size_t at = second.find("\"kind\":\"train\""); at != std::string::npos;
       at = second.find("\"kind\":\"train\"", at + 1))
    ++train_records;
  EXPECT_EQ(train_records, 12u) << second;
}

// AdamW's bf16 and 8-bit moments (optim.adamw_state) come back bitwise, codes and absmax
// included; dimensions of 64 so the matrices are 8-bit under int8 (4096 elements and more)
// while the norm gains keep fp32 moments. Another format cannot continue the state: refused
// by key.
TEST_F(Resume, LowMemoryAdamWStateKillResumesBitwise) {
  const std::string corpus = test::write_tiny_corpus(dir_, 40);
  const std::string shape =
      " --set model.hidden=64 --set model.heads=4 --set model.kv_heads=2 --set model.ffn_hidden=128";
  for (const std::string state : {"bf16", "int8"}) {
    SCOPED_TRACE(state);
    const std::string straight = dir_ + "/straight-" + state, killed = dir_ + "/killed-" + state;
    const std::string set = shape + " --set optim.adamw_state=" + state;
    std::string output;
    ASSERT_EQ(run_with_fault(tiny_train(corpus, straight, set), "", &output), 0) << output;
    EXPECT_CONTAINS(output, ", moments " + state);
    ASSERT_EQ(run_with_fault(tiny_train(corpus, killed, set), "kill_at_step:7", &output), -SIGKILL) << output;
    ASSERT_EQ(run_with_fault(tiny_train(corpus, killed, set + " --resume"), "", &output), 0) << output;
    EXPECT_CONTAINS(output, "resumed from " + test::checkpoint_path(killed, 4) + " at step 4");
    expect_same_run(straight, killed);
    const std::string saved = test::read_file(test::checkpoint_path(straight, 12) + "/optimizer.safetensors");
    EXPECT_EQ(saved, test::read_file(test::checkpoint_path(killed, 12) + "/optimizer.safetensors"))
        << "final optimizer state differs";
    EXPECT_CONTAINS(saved, "layers.0.mlp.down_proj.weight.exp_avg");
    if (state == "int8") {
      EXPECT_CONTAINS(saved, "layers.0.mlp.down_proj.weight.exp_avg_sq.absmax");
      EXPECT_CONTAINS(saved, R"("dtype":"U8")");
    } else {
      EXPECT_CONTAINS(saved, R"("dtype":"BF16")");
    }
    const std::string other = state == "bf16" ? "int8" : "bf16";
    EXPECT_EQ(run_with_fault(tiny_train(corpus, killed, shape + " --resume --set train.steps=14 --set "
                                                                "optim.adamw_state=" + other),
                             "", &output),
              1)
        << output;
    EXPECT_EQ(test::last_line(output), "kiln: error: [checkpoint] " + test::checkpoint_path(killed, 12) +
                                           ": cannot resume, the run differs from the checkpoint in: "
                                           "optim.adamw_state ('" + state + "' -> '" + other + "')");
  }
}

// summary.json and checkpoint.keep_best: the summary names the best of the run's
// validations and its step; the best step's checkpoint is kept (and named by DIR/best)
// beside keep_last = 1; a run killed and resumed ends with the same summary numbers and
// the same best checkpoint, the earlier run's validations included.
TEST_F(Resume, TheSummaryAndTheBestCheckpointCarryOnThroughAKill) {
  const std::string corpus = test::write_tiny_corpus(dir_, 60);
  const std::string straight = dir_ + "/straight", killed = dir_ + "/killed";
  // A high, constant lr: the validation loss goes up and down (measured: best at step 10 of 12).
  const std::string set =
      "--set data.val_fraction=0.3 --set train.eval_every=2 --set train.eval_batches=2 --set checkpoint.keep_last=1"
      " --set checkpoint.keep_best=true --set optim.lr=3e-1 --set optim.schedule=constant";
  std::string output;
  ASSERT_EQ(run_with_fault(tiny_train(corpus, straight, set), "", &output), 0) << output;
  ASSERT_EQ(run_with_fault(tiny_train(corpus, killed, set), "kill_at_step:9", &output), -SIGKILL) << output;
  ASSERT_EQ(run_with_fault(tiny_train(corpus, killed, set + " --resume"), "", &output), 0) << output;
  for (const std::string& run : {straight, killed}) {
    SCOPED_TRACE(run);
    const auto validations = test::metrics_of_kind(run, "validation");
    ASSERT_GE(validations.size(), 6u);
    double best = INFINITY;
    int64_t best_step = 0;
    for (const auto& v : validations)
      if (v["loss"].get<double>() < best) best = v["loss"].get<double>(), best_step = v["step"].get<int64_t>();
    const auto summary = nlohmann::json::parse(test::read_file(run + "/summary.json"));
    EXPECT_EQ(summary["steps"], 12);
    EXPECT_EQ(summary["tokens"], 12 * 512);  // 2 micro-batches of 256 positions a step
    EXPECT_EQ(summary["best_validation_loss"].get<double>(), best);
    EXPECT_EQ(summary["best_validation_step"], best_step);
    EXPECT_TRUE(summary["stopped_by"].is_null());
    EXPECT_LT(best_step, 12) << "the last step was the best: keep_best was not put to the test";
    EXPECT_EQ(test::read_file(run + "/checkpoints/best"), checkpoint_name(best_step) + "\n");
    EXPECT_TRUE(std::filesystem::exists(test::checkpoint_path(run, best_step) + "/manifest.json"));
    EXPECT_TRUE(std::filesystem::exists(test::checkpoint_path(run, 12) + "/manifest.json"));  // keep_last = 1
    EXPECT_EQ(list_checkpoints(run + "/checkpoints").size(), 2u);  // the latest and the best, no earlier best
  }
  const auto a = nlohmann::json::parse(test::read_file(straight + "/summary.json"));
  const auto b = nlohmann::json::parse(test::read_file(killed + "/summary.json"));
  for (const char* key : {"best_validation_loss", "best_validation_step", "final_train_loss", "final_validation_loss",
                          "tokens", "target_tokens"})
    EXPECT_EQ(a[key], b[key]) << key;
}

TEST_F(Resume, KillRightAfterAnEpochBoundaryResumesBitwise) {
  // 10 short documents: an epoch lasts a few steps. log.every = 3 so the resumed run also
  // continues a log window begun before the crash.
  const std::string corpus = test::write_tiny_corpus(dir_, 10);
  const std::string straight = dir_ + "/straight", killed = dir_ + "/killed";
  const std::string extra = "--set log.every=3 ";
  std::string output;
  ASSERT_EQ(run_with_fault(tiny_train(corpus, straight, extra + "--set checkpoint.every=1"), "", &output), 0) << output;
  // The first step whose micro-batches crossed into epoch 1 (reshuffled order).
  int64_t k = 0;
  for (int64_t s = 1; s <= 11 && k == 0; ++s)
    if (read_checkpoint(test::checkpoint_path(straight, s)).state.stream.epoch > 0) k = s;
  ASSERT_GE(k, 2) << "corpus too small: epoch 0 ended inside step 1";
  ASSERT_LE(k, 10) << "corpus too large: no epoch boundary in 10 steps";
  ASSERT_EQ(run_with_fault(tiny_train(corpus, killed, extra + fmt::format("--set checkpoint.every={}", k)),
                           fmt::format("kill_at_step:{}", k + 2), &output),
            -SIGKILL)
      << output;
  ASSERT_EQ(run_with_fault(tiny_train(corpus, killed, extra + fmt::format("--set checkpoint.every={} --resume", k)), "",
                           &output),
            0)
      << output;
  EXPECT_CONTAINS(output, fmt::format("at step {}", k));
  const StreamState at_k = read_checkpoint(test::checkpoint_path(killed, k)).state.stream;
  EXPECT_EQ(at_k.epoch, 1u);
  expect_same_run(straight, killed, 4);  // 12 steps logged every 3
}

// Complete train lines in a metrics file another process is appending to (a line being
// written is not counted, and nothing is parsed).
size_t logged_steps(const std::string& out_dir) {
  const std::string text = test::read_file(out_dir + "/metrics.jsonl");
  size_t n = 0, begin = 0;
  for (size_t end; (end = text.find('\n', begin)) != std::string::npos; begin = end + 1)
    if (text.substr(begin, end - begin).find("\"kind\":\"train\"") != std::string::npos) ++n;
  return n;
}

TEST_F(Resume, SigtermAtARandomStepSavesExitsZeroAndResumesBitwise) {
  const std::string corpus = test::write_tiny_corpus(dir_, 40);
  const std::string straight = dir_ + "/straight", stopped = dir_ + "/stopped";
  std::string output;
  ASSERT_EQ(run_with_fault(tiny_train(corpus, straight), "", &output), 0) << output;

  const int target = std::uniform_int_distribution<int>(2, 9)(*std::make_unique<std::random_device>());
  SCOPED_TRACE(fmt::format("SIGTERM once step {} is logged", target));
  // 40 ms per step keeps the run alive long enough to be signalled mid-way.
  const pid_t pid =
      test::spawn("env KILN_FAULT_INJECT=step_delay_ms:40 " + tiny_train(corpus, stopped), dir_ + "/log.txt");
  ASSERT_GT(pid, 0);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (logged_steps(stopped) < static_cast<size_t>(target) && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  ASSERT_EQ(kill(pid, SIGTERM), 0);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  output = test::read_file(dir_ + "/log.txt");
  ASSERT_TRUE(WIFEXITED(status)) << output;
  EXPECT_EQ(WEXITSTATUS(status), 0) << output;
  const int64_t at = test::train_records(stopped).back().step;
  EXPECT_GE(at, target);
  EXPECT_LT(at, 12) << "the run ended before the signal arrived";
  EXPECT_CONTAINS(output, fmt::format("stopped by SIGTERM after step {}", at));
  EXPECT_EQ(test::latest_of(stopped), fs::path(test::checkpoint_path(stopped, at)).filename().string());

  ASSERT_EQ(run_with_fault(tiny_train(corpus, stopped, "--resume"), "", &output), 0) << output;
  EXPECT_CONTAINS(output, fmt::format("at step {}", at));
  expect_same_run(straight, stopped);
}

TEST_F(Resume, GuardsRefuseAnotherModelOrOtherDataUnlessAllowed) {
  const std::string corpus = test::write_tiny_corpus(dir_, 40);
  const std::string run = dir_ + "/run";
  std::string output;
  ASSERT_EQ(run_with_fault(tiny_train(corpus, run, "--set train.steps=4"), "", &output), 0) << output;
  const std::string ckpt = test::checkpoint_path(run, 4);

  EXPECT_EQ(run_with_fault(tiny_train(corpus, run, "--resume --set model.hidden=48 --set model.ffn_hidden=96"), "",
                           &output),
            1);
  EXPECT_EQ(test::last_line(output), "kiln: error: [checkpoint] " + ckpt +
                                         ": cannot resume, the run differs from the checkpoint in: model.hidden (32 -> "
                                         "48), model.ffn_hidden (64 -> 96)");

  EXPECT_EQ(run_with_fault(tiny_train(corpus, run, "--resume --set data.seed=7"), "", &output), 1);
  EXPECT_CONTAINS(test::last_line(output), "kiln: error: [checkpoint] " + ckpt + ": the training data differs");
  EXPECT_CONTAINS(test::last_line(output), "changed: data.seed");
  EXPECT_CONTAINS(test::last_line(output), "--allow-data-change");

  test::write_file(corpus, test::read_file(corpus) + "one more document.\n\n");
  EXPECT_EQ(run_with_fault(tiny_train(corpus, run, "--resume"), "", &output), 1);
  EXPECT_CONTAINS(test::last_line(output), "changed: the contents of data.path");

  ASSERT_EQ(run_with_fault(tiny_train(corpus, run, "--resume --allow-data-change --set train.steps=6"), "", &output), 0)
      << output;
  EXPECT_CONTAINS(output, "the data changed (--allow-data-change)");
  EXPECT_CONTAINS(output, "configuration changed since the checkpoint: train.steps (4 -> 6)");
  EXPECT_EQ(test::latest_of(run), "step-00000006");
}

TEST_F(Resume, ResumeWithNothingSavedYetStartsFresh) {
  const std::string corpus = test::write_tiny_corpus(dir_, 40);
  std::string output;
  ASSERT_EQ(run_with_fault(tiny_train(corpus, dir_ + "/fresh", "--set train.steps=2 --resume"), "", &output), 0)
      << output;
  EXPECT_CONTAINS(output, "resume: no checkpoint in " + dir_ + "/fresh/checkpoints yet; starting from step 0");
}

}  // namespace
}  // namespace kiln

// Fault tests: each injects a real fault into a real `kiln train` process (SIGKILL in the
// middle of a checkpoint write, a disk that fills up, a file-size limit, an unwritable
// directory, a NaN loss, an Inf gradient, a gradient spike, a plan that cannot fit) and
// checks what a user would: the exit code, the one-line error, what is on disk, and that
// the next start resumes to the same bits as a run that never failed.
// docs/reliability.md lists every fault and the test that shows it.
#include "fault_test_util.h"

#include "train/checkpoint.h"

#include <sys/stat.h>

namespace kiln {
namespace {

namespace fs = std::filesystem;
using test::run_with_fault;
using test::tiny_train;

class Faults : public test::TinyRunTest {
 protected:
  Faults() : test::TinyRunTest("kiln-faults", 40) {}
  std::string run_dir(const std::string& name) const { return dir_ + "/" + name; }
  // A straight 12-step run: the reference a recovered run must equal bitwise.
  std::string straight() {
    const std::string out = run_dir("straight");
    std::string output;
    EXPECT_EQ(run_with_fault(tiny_train(corpus_, out), "", &output), 0) << output;
    return out;
  }
  void expect_same_run(const std::string& a, const std::string& b) {
    EXPECT_EQ(test::train_records(a), test::train_records(b));
    EXPECT_EQ(test::train_records(b).size(), 12u);
    EXPECT_EQ(test::read_file(a + "/model/model.safetensors"), test::read_file(b + "/model/model.safetensors"))
        << "final weights differ";
  }
};

// ---- kill -9 during a checkpoint write --------------------------------------------

struct KillPoint {
  const char* point;
  int64_t resumes_at;  // the second save (step 8) dies; before the rename, step 4 is what is left
};

class KillDuringCheckpointWrite : public Faults, public ::testing::WithParamInterface<KillPoint> {};

TEST_P(KillDuringCheckpointWrite, NextStartResumesFromTheLastCompleteCheckpoint) {
  const KillPoint& k = GetParam();
  const std::string reference = straight();
  const std::string out = run_dir("killed");
  std::string output;
  ASSERT_EQ(run_with_fault(tiny_train(corpus_, out), std::string("checkpoint_write:") + k.point + "@2", &output),
            -SIGKILL)
      << output;
  EXPECT_EQ(test::latest_of(out), fs::path(test::checkpoint_path(out, k.resumes_at)).filename().string());

  ASSERT_EQ(run_with_fault(tiny_train(corpus_, out, "--resume"), "", &output), 0) << output;
  EXPECT_CONTAINS(output, fmt::format("resumed from {} at step {}", test::checkpoint_path(out, k.resumes_at),
                                      k.resumes_at));
  if (k.resumes_at == 4 && std::string(k.point) != "rename") EXPECT_CONTAINS(output, "left by an interrupted save");
  EXPECT_EQ(test::count_leftovers(out), 0);
  expect_same_run(reference, out);
  // Every checkpoint on disk is complete and verifies.
  for (const auto& [step, path] : list_checkpoints(out + "/checkpoints")) EXPECT_NO_THROW(read_checkpoint(path)) << path;
}

INSTANTIATE_TEST_SUITE_P(Points, KillDuringCheckpointWrite,
                         ::testing::Values(KillPoint{"begin", 4}, KillPoint{"model", 4}, KillPoint{"optimizer", 4},
                                           KillPoint{"partial", 4}, KillPoint{"state", 4}, KillPoint{"manifest", 4},
                                           KillPoint{"rename", 4}, KillPoint{"latest", 8}),
                         [](const auto& info) { return std::string(info.param.point); });

// ---- damaged checkpoint files -----------------------------------------------------

TEST_F(Faults, TruncatedOrFlippedCheckpointFileIsRefusedNamingTheFile) {
  const std::string out = run_dir("damaged");
  std::string output;
  ASSERT_EQ(run_with_fault(tiny_train(corpus_, out, "--set train.steps=4"), "", &output), 0) << output;
  const std::string ckpt = test::checkpoint_path(out, 4);
  const std::string model = ckpt + "/model.safetensors", optimizer = ckpt + "/optimizer.safetensors";
  const std::string model_bytes = test::read_file(model), optimizer_bytes = test::read_file(optimizer);

  fs::resize_file(model, model_bytes.size() - 100);
  EXPECT_NE(run_with_fault(tiny_train(corpus_, out, "--resume"), "", &output), 0);
  EXPECT_EQ(test::last_line(output), fmt::format("kiln: error: [checkpoint] {}: truncated ({} bytes, the manifest "
                                                 "says {})",
                                                 model, model_bytes.size() - 100, model_bytes.size()));
  test::write_file(model, model_bytes);

  std::string flipped = optimizer_bytes;
  flipped[flipped.size() / 2] ^= 0x10;  // one bit of one weight's moment
  test::write_file(optimizer, flipped);
  EXPECT_NE(run_with_fault(tiny_train(corpus_, out, "--resume " + ckpt), "", &output), 0);
  EXPECT_CONTAINS(test::last_line(output), "kiln: error: [checkpoint] " + optimizer + ": checksum mismatch");
  test::write_file(optimizer, optimizer_bytes);

  std::string manifest = test::read_file(ckpt + "/manifest.json");
  manifest[manifest.find("\"bytes\": ") + 9] ^= 0x01;  // a size digit
  test::write_file(ckpt + "/manifest.json", manifest);
  EXPECT_NE(run_with_fault(tiny_train(corpus_, out, "--resume"), "", &output), 0);
  EXPECT_CONTAINS(test::last_line(output), ckpt + "/manifest.json");

  fs::remove(ckpt + "/manifest.json");
  EXPECT_NE(run_with_fault(tiny_train(corpus_, out, "--resume " + ckpt), "", &output), 0);
  EXPECT_EQ(test::last_line(output), "kiln: error: [checkpoint] " + ckpt + ": incomplete checkpoint (no manifest.json)");
}

// ---- no space left / write failures -----------------------------------------------

TEST_F(Faults, DiskFullDuringSaveStopsLoudlyAndKeepsThePreviousCheckpoint) {
  const std::string out = run_dir("enospc");
  std::string output;
  ASSERT_EQ(run_with_fault(tiny_train(corpus_, out), "checkpoint_enospc:2", &output), 1) << output;
  EXPECT_CONTAINS(test::last_line(output), "kiln: error: [checkpoint] " + test::checkpoint_path(out, 8) +
                                               ": save failed: [safetensors] ");
  EXPECT_CONTAINS(test::last_line(output), "No space left on device");
  EXPECT_EQ(test::latest_of(out), "step-00000004");
  EXPECT_FALSE(fs::exists(test::checkpoint_path(out, 8)));
  EXPECT_EQ(test::count_leftovers(out), 0);
  EXPECT_NO_THROW(read_checkpoint(test::checkpoint_path(out, 4)));
  // And the intact checkpoint resumes to the uninterrupted result.
  ASSERT_EQ(run_with_fault(tiny_train(corpus_, out, "--resume"), "", &output), 0) << output;
  expect_same_run(straight(), out);
}

TEST_F(Faults, DiskFullWithOnSaveErrorContinueWarnsAndTrainsOn) {
  const std::string out = run_dir("enospc-continue");
  std::string output;
  ASSERT_EQ(run_with_fault(tiny_train(corpus_, out, "--set checkpoint.on_save_error=continue"), "checkpoint_enospc:2",
                           &output),
            0)
      << output;
  EXPECT_CONTAINS(output, "kiln: warning: [checkpoint] " + test::checkpoint_path(out, 8) + ": save failed");
  EXPECT_FALSE(fs::exists(test::checkpoint_path(out, 8)));
  EXPECT_EQ(test::latest_of(out), "step-00000012");  // the final save worked again
  EXPECT_EQ(test::train_records(out).size(), 12u);
}

TEST_F(Faults, RealWriteFailureFromAFileSizeLimitKeepsLatest) {
  const std::string out = run_dir("fsize");
  std::string output;
  ASSERT_EQ(run_with_fault(tiny_train(corpus_, out, "--set train.steps=4"), "", &output), 0) << output;
  // ulimit -f 48 (24 or 48 KiB by shell): metrics and configs (13 KiB) fit, the 70 KiB
  // weight file does not: its write fails with EFBIG.
  ASSERT_EQ(run_with_fault("ulimit -f 48; " + tiny_train(corpus_, out, "--resume --set checkpoint.save_final=false"), "", &output),
            1)
      << output;
  EXPECT_CONTAINS(test::last_line(output), "kiln: error: [checkpoint] " + test::checkpoint_path(out, 8) +
                                               ": save failed: [safetensors] ");
  EXPECT_CONTAINS(test::last_line(output), "File too large");
  EXPECT_EQ(test::latest_of(out), "step-00000004");
  EXPECT_EQ(test::count_leftovers(out), 0);
  EXPECT_NO_THROW(read_checkpoint(test::checkpoint_path(out, 4)));
}

// A full disk for the run's small files: /dev/full fails every write with ENOSPC, so a
// file linked to it is a file on a full disk (config.toml is written to config.toml.tmp,
// then renamed into place).
TEST_F(Faults, FullDiskForTheConfigOrTheMetricsStopsLoudly) {
  if (!fs::exists("/dev/full")) GTEST_SKIP() << "no /dev/full";
  std::string output;
  const std::string config = run_dir("config");
  fs::create_directories(config);
  fs::create_symlink("/dev/full", config + "/config.toml.tmp");
  EXPECT_EQ(run_with_fault(tiny_train(corpus_, config), "", &output), 1) << output;
  EXPECT_EQ(test::last_line(output),
            "kiln: error: [train] " + config + "/config.toml.tmp: write failed: No space left on device");
  EXPECT_EQ(output.find("step "), std::string::npos) << output;

  const std::string metrics = run_dir("metrics");
  fs::create_directories(metrics);
  fs::create_symlink("/dev/full", metrics + "/metrics.jsonl");
  // --resume: a fresh run would refuse the planted metrics file as an earlier run's.
  EXPECT_EQ(run_with_fault(tiny_train(corpus_, metrics, "--resume"), "", &output), 1) << output;
  EXPECT_EQ(test::last_line(output), "kiln: error: [metrics] " + metrics +
                                         "/metrics.jsonl: write failed: No space left on device "
                                         "(checkpoint.on_save_error = stop)");
}

TEST_F(Faults, FullDiskForTheMetricsWithOnSaveErrorContinueWarnsOnceAndTrainsOn) {
  if (!fs::exists("/dev/full")) GTEST_SKIP() << "no /dev/full";
  const std::string out = run_dir("metrics-continue");
  fs::create_directories(out);
  fs::create_symlink("/dev/full", out + "/metrics.jsonl");
  std::string output;
  // --resume: a fresh run would refuse the planted metrics file as an earlier run's.
  ASSERT_EQ(run_with_fault(tiny_train(corpus_, out, "--resume --set checkpoint.on_save_error=continue"), "", &output), 0)
      << output;
  const std::string warning = "kiln: warning: [metrics] " + out + "/metrics.jsonl: write failed: No space left on device";
  EXPECT_CONTAINS(output, warning);
  EXPECT_EQ(output.find(warning), output.rfind(warning)) << "warned more than once:\n" << output;
  EXPECT_CONTAINS(output, "done: 12 steps");
  EXPECT_TRUE(fs::exists(out + "/model/model.safetensors"));
  EXPECT_EQ(test::latest_of(out), "step-00000012");
}

// The other commands' files on a full disk: an exported config.json, a trained tokenizer.
TEST_F(Faults, FullDiskForExportedOrTrainedFilesIsAnError) {
  if (!fs::exists("/dev/full")) GTEST_SKIP() << "no /dev/full";
  std::string output;
  const std::string run = run_dir("run");
  ASSERT_EQ(run_with_fault(tiny_train(corpus_, run, "--set train.steps=1"), "", &output), 0) << output;
  const std::string hf = run_dir("hf");
  fs::create_directories(hf);
  fs::create_symlink("/dev/full", hf + "/config.json");
  EXPECT_EQ(run_with_fault(test::kiln_binary() + " export hf " + run + "/model " + hf, "", &output), 1) << output;
  EXPECT_EQ(test::last_line(output), "kiln: error: [export] " + hf + "/config.json: write failed: No space left on device");

  const std::string tok = run_dir("tok");
  fs::create_directories(tok);
  fs::create_symlink("/dev/full", tok + "/tokenizer.json");
  EXPECT_EQ(run_with_fault(test::kiln_binary() + " train-tokenizer " + corpus_ + " --vocab-size 262 --out " + tok, "",
                           &output),
            1)
      << output;
  EXPECT_EQ(test::last_line(output),
            "kiln: error: [train-tokenizer] " + tok + "/tokenizer.json: cannot write: No space left on device");
}

// ---- unusable directories ---------------------------------------------------------

TEST_F(Faults, UnusableOutputOrCheckpointDirectoryFailsBeforeTraining) {
  test::write_file(dir_ + "/a-file", "x");
  std::string output;
  EXPECT_EQ(run_with_fault(tiny_train(corpus_, dir_ + "/a-file/run"), "", &output), 1);
  EXPECT_CONTAINS(test::last_line(output), "kiln: error: [train.out_dir] ");
  EXPECT_EQ(output.find("step "), std::string::npos) << output;

  EXPECT_EQ(run_with_fault(tiny_train(corpus_, run_dir("ok"), "--set checkpoint.dir=" + dir_ + "/a-file/ckpt"), "",
                           &output),
            1);
  EXPECT_EQ(test::last_line(output), "kiln: error: [checkpoint.dir] " + dir_ + "/a-file/ckpt: cannot create: Not a directory");

  EXPECT_EQ(run_with_fault(tiny_train(corpus_, run_dir("ok"), "--resume " + dir_ + "/nothing-here"), "", &output), 1);
  EXPECT_EQ(test::last_line(output),
            "kiln: error: [checkpoint] " + dir_ + "/nothing-here: no such checkpoint or checkpoint directory");

  // Read-only: a 0555 directory, or for root (whom permissions do not stop) sysfs.
  std::string readonly = run_dir("readonly");
  fs::create_directories(readonly);
  chmod(readonly.c_str(), 0555);
  if (geteuid() == 0) readonly = "/sys";
  if (access(readonly.c_str(), W_OK) == 0 && geteuid() != 0) GTEST_SKIP() << "cannot make a read-only directory";
  EXPECT_EQ(run_with_fault(tiny_train(corpus_, readonly), "", &output), 1);
  EXPECT_CONTAINS(test::last_line(output), "kiln: error: [train.out_dir] ");
  EXPECT_EQ(output.find("step "), std::string::npos) << output;
  chmod(run_dir("readonly").c_str(), 0755);
}

// ---- numerical faults -------------------------------------------------------------

// Checkpoints after every step make "weights unchanged bitwise" a file comparison.
TEST_F(Faults, NanLossAndInfGradientSkipTheUpdateLeavingEverythingBitwiseUnchanged) {
  const std::string out = run_dir("numeric");
  std::string output;
  ASSERT_EQ(run_with_fault(tiny_train(corpus_, out, "--set train.steps=7 --set checkpoint.every=1"),
                           "nan_loss:3,inf_grad:5", &output),
            0)
      << output;
  EXPECT_CONTAINS(output, "step 3: update skipped (non-finite loss nan)");
  EXPECT_CONTAINS(output, "step 5: update skipped (non-finite gradient norm inf)");
  auto bytes = [&](int64_t step, const char* file) { return test::read_file(test::checkpoint_path(out, step) + "/" + file); };
  for (const int64_t bad : {3, 5}) {
    EXPECT_EQ(bytes(bad - 1, "model.safetensors"), bytes(bad, "model.safetensors")) << "weights moved at step " << bad;
    EXPECT_EQ(bytes(bad - 1, "optimizer.safetensors"), bytes(bad, "optimizer.safetensors")) << "optimizer at " << bad;
    EXPECT_NE(bytes(bad, "model.safetensors"), bytes(bad + 1, "model.safetensors")) << "training resumed after " << bad;
  }
  EXPECT_EQ(read_checkpoint(test::checkpoint_path(out, 5)).state.optimizer_steps, 3);
  const auto skips = test::metrics_of_kind(out, "skip");
  ASSERT_EQ(skips.size(), 2u);
  EXPECT_EQ(skips[0]["step"], 3);
  EXPECT_TRUE(skips[0]["loss"].is_null());
  EXPECT_EQ(skips[1]["step"], 5);
  // The schedule did not move on a skipped step: the lr of step 4 is the lr of step 3.
  const auto records = test::train_records(out);
  EXPECT_EQ(records[2].lr, records[3].lr);
}

TEST_F(Faults, TooManyConsecutiveSkipsStopTheRun) {
  std::string output;
  EXPECT_EQ(run_with_fault(tiny_train(corpus_, run_dir("skips"), "--set train.max_consecutive_skips=3"),
                           "nan_loss:2-9", &output),
            1);
  EXPECT_EQ(test::last_line(output),
            "kiln: error: [train] step 4: 3 consecutive updates skipped (last: non-finite loss nan); stopping "
            "(train.max_consecutive_skips = 3). Resume from the last checkpoint, e.g. with a lower optim.lr");
}

TEST_F(Faults, SpikeGuardSkipsAGradientSpike) {
  const std::string out = run_dir("spike");
  std::string output;
  ASSERT_EQ(run_with_fault(tiny_train(corpus_, out, "--set train.steps=8 --set checkpoint.every=1 --set train.spike_window=3"),
                           "grad_spike:6", &output),
            0)
      << output;
  EXPECT_CONTAINS(output, "step 6: update skipped (gradient norm spike");
  EXPECT_EQ(test::read_file(test::checkpoint_path(out, 5) + "/model.safetensors"),
            test::read_file(test::checkpoint_path(out, 6) + "/model.safetensors"));
  EXPECT_EQ(read_checkpoint(test::checkpoint_path(out, 8)).state.guard.recent_loss.size(), 3u);
}

// ---- memory ------------------------------------------------------------------------

TEST_F(Faults, PlanThatCannotFitStopsBeforeAllocatingWithTheBreakdown) {
  std::string output;
  // 2^31 - 1 tokens per micro-batch (the most train.micro_batch_tokens allows): terabytes
  // of activations on any machine.
  EXPECT_EQ(run_with_fault(tiny_train(corpus_, run_dir("oom"), "--set train.micro_batch_tokens=2147483647"), "",
                           &output),
            1);
  const std::string line = test::last_line(output);
  EXPECT_CONTAINS(line, "kiln: error: [memory] the run needs ");
  for (const char* part : {"parameters", "gradients", "optimizer state", "activations", "workspace",
                           "the largest train.micro_batch_tokens that fits is "})
    EXPECT_CONTAINS(line, part);
}

}  // namespace
}  // namespace kiln

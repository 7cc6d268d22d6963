// A run directory holds one run (issue 38, item 1). A fresh run into a directory holding an
// earlier run used to replace its model, summary, config and checkpoints step by step, and
// a later --resume could continue the other run's checkpoint; two runs started together
// both wrote there. Now: a fresh run is refused (loses nothing) unless --overwrite, which
// removes the earlier run first; a second process is locked out, named by pid; and every
// checkpoint carries its run's id, so --resume refuses another run's. Real `kiln` processes.
#include "fault_test_util.h"

#include "train/checkpoint_state.h"
#include "train/run_directory.h"

#include <filesystem>
#include <map>
#include <thread>

using namespace kiln;
using namespace kiln::test;
namespace fs = std::filesystem;

namespace {

class RunDir : public TinyRunTest {
 protected:
  RunDir() : TinyRunTest("kiln_run_directory") {}
};

// Every file under `root` and its bytes, but the lock file (it names the last holder's pid).
std::map<std::string, std::string> snapshot(const std::string& root) {
  std::map<std::string, std::string> files;
  for (const auto& e : fs::recursive_directory_iterator(root))
    if (e.is_regular_file() && e.path().filename() != "kiln.lock") files[e.path().string()] = read_file(e.path().string());
  return files;
}

std::string run_id_of(const std::string& out_dir) {
  std::string id = read_file(out_dir + "/run_id");
  while (!id.empty() && id.back() == '\n') id.pop_back();
  return id;
}

std::string checkpoint_run_id(const std::string& checkpoint) {
  return nlohmann::json::parse(read_file(checkpoint + "/state.json"))["run_id"].get<std::string>();
}

}  // namespace

TEST_F(RunDir, AFreshRunIntoAnEarlierRunIsRefusedAndLosesNothing) {
  const std::string out = dir_ + "/run";
  std::string output;
  ASSERT_EQ(run_with_fault(tiny_train(corpus_, out), "", &output), 0) << output;
  const auto before = snapshot(out);
  ASSERT_TRUE(before.count(out + "/model/model.safetensors"));
  ASSERT_TRUE(before.count(checkpoint_path(out, 12) + "/manifest.json"));

  EXPECT_EQ(run_with_fault(tiny_train(corpus_, out, "--set optim.lr=5e-3"), "", &output), 1) << output;
  EXPECT_EQ(std::count(output.begin(), output.end(), '\n'), 1) << output;
  EXPECT_CONTAINS(output, "kiln: error: [train.out_dir] " + out + " holds an earlier run (");
  EXPECT_CONTAINS(output, "pass --resume to continue it, --overwrite to replace it, or choose another train.out_dir");
  EXPECT_EQ(snapshot(out), before) << "a refused run changed a file";
}

// --overwrite removes the earlier run's files (kiln's own only) before the new run writes:
// no checkpoint, metrics record or model of the first run is left to mix with the second.
TEST_F(RunDir, OverwriteReplacesTheEarlierRunWhole) {
  const std::string out = dir_ + "/run";
  std::string output;
  ASSERT_EQ(run_with_fault(tiny_train(corpus_, out, "--set train.steps=16"), "", &output), 0) << output;
  const std::string first_id = run_id_of(out);
  write_file(out + "/notes.txt", "mine");
  ASSERT_EQ(run_with_fault(tiny_train(corpus_, out, "--overwrite"), "", &output), 0) << output;
  EXPECT_CONTAINS(output, "overwrite: removed the earlier run's files from " + out);
  const std::string second_id = run_id_of(out);
  EXPECT_EQ(second_id.size(), 16u);
  EXPECT_NE(second_id, first_id);
  EXPECT_FALSE(fs::exists(checkpoint_path(out, 16))) << "the first run's step 16 was left among the second's";
  for (int step : {4, 8, 12}) EXPECT_EQ(checkpoint_run_id(checkpoint_path(out, step)), second_id) << step;
  EXPECT_EQ(steps_of(metrics_of_kind(out, "train")).size(), 12u);
  EXPECT_FALSE(fs::exists(out + "/metrics.jsonl.previous"));
  EXPECT_EQ(read_file(out + "/notes.txt"), "mine");  // not kiln's: left alone

  EXPECT_EQ(run_with_fault(tiny_train(corpus_, out, "--overwrite --resume"), "", &output), 1) << output;
  EXPECT_CONTAINS(output, "kiln: error: [train] --overwrite starts afresh and --resume continues a run: pass one of them");
}

// A second process into a directory a run holds is refused naming the holder; the lock
// dies with its holder (SIGKILL leaves none behind).
TEST_F(RunDir, ASecondRunIsLockedOutNamingTheHoldersPid) {
  const std::string out = dir_ + "/run";
  const pid_t first = spawn(tiny_train(corpus_, out, "--set train.steps=1000000 --set checkpoint.every=0"),
                            dir_ + "/first.log");
  for (int i = 0; i < 600 && !fs::exists(out + "/metrics.jsonl"); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  ASSERT_TRUE(fs::exists(out + "/metrics.jsonl")) << read_file(dir_ + "/first.log");
  std::string output;
  for (const char* flags : {"--overwrite", "--resume"}) {
    SCOPED_TRACE(flags);
    EXPECT_EQ(run_with_fault(tiny_train(corpus_, out, flags), "", &output), 1) << output;
    EXPECT_EQ(std::count(output.begin(), output.end(), '\n'), 1) << output;
    EXPECT_CONTAINS(output, fmt::format("kiln: error: [train.out_dir] {}: in use by another kiln run (pid {}, which "
                                        "holds {}/kiln.lock)", out, first, out));
  }
  kill(first, SIGKILL);
  int status = 0;
  waitpid(first, &status, 0);
  // The killed run had no checkpoint: a restart with --resume takes the directory over.
  ASSERT_EQ(run_with_fault(tiny_train(corpus_, out, "--resume --set train.steps=4"), "", &output), 0) << output;
  EXPECT_CONTAINS(output, "resume: no checkpoint in " + out + "/checkpoints yet; starting from step 0");
}

// --resume continues only the run directory's own run: a checkpoint of another run (named,
// or the newest one when `latest` is missing) is refused naming both runs.
TEST_F(RunDir, ResumeRefusesAnotherRunsCheckpoint) {
  const std::string a = dir_ + "/a", b = dir_ + "/b";
  std::string output;
  ASSERT_EQ(run_with_fault(tiny_train(corpus_, a), "", &output), 0) << output;
  ASSERT_EQ(run_with_fault(tiny_train(corpus_, b), "kill_at_step:6", &output), -SIGKILL) << output;
  const std::string a_id = run_id_of(a), b_id = run_id_of(b);
  ASSERT_NE(a_id, b_id);
  EXPECT_EQ(checkpoint_run_id(checkpoint_path(a, 8)), a_id);

  const std::string foreign = checkpoint_path(a, 8);
  const std::string refusal = fmt::format("kiln: error: [checkpoint] {}: belongs to run {}, but {} holds run {} "
                                          "({}/run_id)", "{}", a_id, b, b_id, b);
  EXPECT_EQ(run_with_fault(tiny_train(corpus_, b, "--resume " + foreign), "", &output), 1) << output;
  EXPECT_CONTAINS(output, fmt::format(fmt::runtime(refusal), foreign));
  // The other run's newer checkpoint among this run's, `latest` gone: no longer taken.
  fs::copy(foreign, checkpoint_path(b, 8), fs::copy_options::recursive);
  fs::remove(b + "/checkpoints/latest");
  EXPECT_EQ(run_with_fault(tiny_train(corpus_, b, "--resume"), "", &output), 1) << output;
  EXPECT_CONTAINS(output, fmt::format(fmt::runtime(refusal), checkpoint_path(b, 8)));
  // Its own checkpoint resumes.
  fs::remove_all(checkpoint_path(b, 8));
  ASSERT_EQ(run_with_fault(tiny_train(corpus_, b, "--resume"), "", &output), 0) << output;
  EXPECT_CONTAINS(output, "resumed from " + checkpoint_path(b, 4) + " at step 4");
  EXPECT_EQ(checkpoint_run_id(checkpoint_path(b, 12)), b_id);
}

// Checkpoints written before runs had ids carry none: accepted, as are directories
// without a run_id file.
TEST(RunDirectoryIds, CheckpointsWithoutARunIdAreAccepted) {
  CheckpointState state;
  state.config_toml = "";
  nlohmann::json j = nlohmann::json::parse(state_to_json(state));
  j.erase("run_id");
  j.erase("world_size");
  const CheckpointState read = state_from_json(j.dump(), "state.json");
  EXPECT_EQ(read.run_id, "");
  EXPECT_EQ(read.world_size, 0);
  EXPECT_NO_THROW(check_same_run("ckpt", "", "out", "0123456789abcdef"));
  EXPECT_NO_THROW(check_same_run("ckpt", "0123456789abcdef", "out", ""));
  EXPECT_NO_THROW(check_same_run("ckpt", "0123456789abcdef", "out", "0123456789abcdef"));
  EXPECT_THROW(check_same_run("ckpt", "0123456789abcdef", "out", "fedcba9876543210"), Error);
  EXPECT_NE(new_run_id(), new_run_id());
}

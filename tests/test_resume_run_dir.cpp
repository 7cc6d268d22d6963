// `kiln train RUN_DIR --resume`: a run directory stands for the configuration its run
// saved, so a resume repeats none of the original --set values. Real `kiln` processes.
#include "fault_test_util.h"

namespace kiln {
namespace {

namespace fs = std::filesystem;
using test::run_with_fault;
using test::tiny_train;

class ResumeRunDir : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = test::temp_dir("kiln-resume-run-dir");
    corpus_ = test::write_tiny_corpus(dir_, 40);
    run_ = dir_ + "/run";
  }
  void TearDown() override {
    if (!HasFailure()) fs::remove_all(dir_);
  }
  // Two steps of the tiny run: its model (hidden 32, 1 layer, ...) is set only by --set,
  // so a resume that did not read the saved config would refuse another model.
  void train_two_steps() {
    std::string output;
    ASSERT_EQ(run_with_fault(tiny_train(corpus_, run_, "--set train.steps=2"), "", &output), 0) << output;
  }
  std::string dir_, corpus_, run_;
};

TEST_F(ResumeRunDir, ContinuesWithTheSavedConfigAndOnlyTheNewSet) {
  train_two_steps();
  std::string output;
  ASSERT_EQ(run_with_fault(test::kiln_binary() + " train " + run_ + " --resume --set train.steps=4", "", &output), 0)
      << output;
  EXPECT_CONTAINS(output, "resumed from " + test::checkpoint_path(run_, 2) + " at step 2");
  EXPECT_EQ(test::steps_of(test::metrics_of_kind(run_, "train")), (std::vector<int64_t>{1, 2, 3, 4}));
  EXPECT_EQ(test::metrics_of_kind(run_, "resume").size(), 1u);
  // The run's config.toml now records the new step count, and still the --set model.
  const std::string saved = test::read_file(run_ + "/config.toml");
  EXPECT_CONTAINS(saved, "\nsteps = 4 ");
  EXPECT_CONTAINS(saved, "\nhidden = 32 ");
}

TEST_F(ResumeRunDir, RefusesWhatIsNotARunDirectory) {
  train_two_steps();
  const std::string kiln = test::kiln_binary();
  // Without --resume a directory is no config: the error says how to continue it.
  EXPECT_CONTAINS(test::one_line_error(kiln + " train " + run_), "kiln train " + run_ + " --resume");
  // A model directory holds a config.toml too, of the run around it.
  EXPECT_CONTAINS(test::one_line_error(kiln + " train " + run_ + "/model --resume"),
                  run_ + "/model is not a run's train.out_dir");
  fs::create_directories(dir_ + "/empty");
  EXPECT_CONTAINS(test::one_line_error(kiln + " train " + dir_ + "/empty --resume"), "holds no config.toml");
  // Nothing was lost: the run is still there, at its step.
  EXPECT_EQ(test::steps_of(test::metrics_of_kind(run_, "train")), (std::vector<int64_t>{1, 2}));
}

}  // namespace
}  // namespace kiln

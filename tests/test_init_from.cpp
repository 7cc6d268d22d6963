// train.init_from (continued pretraining), with real `kiln train` processes: a second run
// started from a first run's model, one of its checkpoints, or its Hugging Face export logs
// as its first loss exactly the loss the first model scores on that step's batches, while
// its optimizer, step count and schedule start fresh; a model of other shapes, a missing
// path and a folder holding no model are refused naming the key; a resume ignores the key.
#include "fault_test_util.h"

#include "data/batch_stream.h"
#include "data/packer.h"
#include "io/model_io.h"
#include "ops/parallel.h"
#include "train/trainer.h"

#include <cmath>

namespace kiln {
namespace {

namespace fs = std::filesystem;
using test::run_with_fault;
using test::tiny_train;

class InitFrom : public test::TinyRunTest {
 protected:
  InitFrom() : TinyRunTest("kiln-init-from", 40) {}

  // The first run, whose model the others start from: 12 steps, checkpoints every 4.
  std::string train_source() {
    const std::string out = dir_ + "/source";
    std::string output;
    EXPECT_EQ(run_with_fault(tiny_train(corpus_, out), "", &output), 0) << output;
    return out;
  }

  // `kiln train` of 4 steps into `out`, starting from `init_from`; its exit code.
  int train_from(const std::string& init_from, const std::string& out, std::string* output,
                 const std::string& extra = "") {
    const std::string settings = "--set train.steps=4 --set train.init_from=" + init_from + " " + extra;
    return run_with_fault(tiny_train(corpus_, out, settings), "", output);
  }

  // The mean loss the model in `model_dir` scores on the first step's micro-batches of the
  // run in `run_dir` (its resolved config.toml: same data, packing and seed), computed here
  // through the library, apart from the trainer.
  static double first_step_loss(const std::string& model_dir, const std::string& run_dir) {
    const Config config = load_config(run_dir + "/config.toml");
    set_cpu_threads(config.train.threads);
    const auto tokenizer = tokenizer_from_config(config.data.tokenizer);
    const TokenDataset dataset(config.data, *tokenizer);
    const Packer packer(packer_options(config, *tokenizer));
    BatchStream stream(dataset, Split::train, packer, config.data);
    BuildOptions options = training_build_options(config, Device::cpu);
    options.training = false;
    io::LoadedModel loaded = io::load_model(model_dir, options);
    double loss = 0;
    int64_t targets = 0;
    for (int64_t i = 0; i < config.train.grad_accum; ++i) {
      HostBatch batch;
      stream.next(batch);
      loaded.model->load_batch(batch);
      const LossSums sums = loaded.model->evaluate();
      loss += sums.loss;
      targets += sums.count;
    }
    return loss / static_cast<double>(targets);
  }

  // The run in `out` started from the weights in `model_dir`: its first loss is theirs on
  // its first batches, and its step, schedule and optimizer began at zero.
  void expect_started_from(const std::string& model_dir, const std::string& out, const std::string& source) {
    const auto records = test::train_records(out);
    ASSERT_EQ(records.size(), 4u);
    EXPECT_EQ(records[0].step, 1);
    EXPECT_NEAR(records[0].loss.get<double>(), first_step_loss(model_dir, out), 1e-6);
    const auto fresh = test::train_records(source);
    ASSERT_FALSE(fresh.empty());
    // A random init starts near ln(259) = 5.56; the trained model well below it.
    EXPECT_GT(fresh[0].loss.get<double>(), std::log(259.0) - 0.5);
    EXPECT_LT(records[0].loss.get<double>(), fresh[0].loss.get<double>() - 1.0);
    EXPECT_EQ(records[0].lr, fresh[0].lr) << "the schedule starts again from its warmup";
    const auto state = nlohmann::json::parse(test::read_file(test::checkpoint_path(out, 4) + "/state.json"));
    EXPECT_EQ(state["optimizer_steps"], 4) << "the optimizer starts fresh";
    const auto source_state =
        nlohmann::json::parse(test::read_file(test::checkpoint_path(source, 4) + "/state.json"));
    EXPECT_EQ(state["data"], source_state["data"]) << "the data is read from its start";
  }
};

TEST_F(InitFrom, AModelFolderStartsAtThatModelsLoss) {
  const std::string source = train_source();
  const std::string out = dir_ + "/continued";
  std::string output;
  ASSERT_EQ(train_from(source + "/model", out, &output), 0) << output;
  EXPECT_CONTAINS(output, "init: weights from " + source + "/model (kiln model)");
  expect_started_from(source + "/model", out, source);
}

TEST_F(InitFrom, ACheckpointFolderStartsAtThatCheckpointsLoss) {
  const std::string source = train_source();
  const std::string checkpoint = test::checkpoint_path(source, 8), out = dir_ + "/continued";
  std::string output;
  ASSERT_EQ(train_from(checkpoint, out, &output), 0) << output;
  EXPECT_CONTAINS(output, "init: weights from " + checkpoint);
  expect_started_from(checkpoint, out, source);
}

TEST_F(InitFrom, AHuggingFaceExportStartsAtItsModelsLoss) {
  const std::string source = train_source();
  const std::string hf = dir_ + "/hf", out = dir_ + "/continued";
  std::string output;
  ASSERT_EQ(test::run_command(test::kiln_binary() + " export hf " + source + "/model " + hf, &output), 0) << output;
  ASSERT_TRUE(fs::exists(hf + "/config.json"));
  ASSERT_EQ(train_from(hf, out, &output), 0) << output;
  EXPECT_CONTAINS(output, "init: weights from " + hf + " (Hugging Face qwen3)");
  expect_started_from(source + "/model", out, source);  // float32 export: the same weights
  // The README's way: `kiln import hf` first, then init_from the imported model directory.
  const std::string imported = dir_ + "/imported", from_import = dir_ + "/from-import";
  ASSERT_EQ(test::run_command(test::kiln_binary() + " import hf " + hf + " " + imported, &output), 0) << output;
  ASSERT_EQ(train_from(imported, from_import, &output), 0) << output;
  EXPECT_CONTAINS(output, "init: weights from " + imported + " (kiln model)");
  expect_started_from(source + "/model", from_import, source);
}

TEST_F(InitFrom, AModelOfOtherShapesIsRefusedNamingTheTensorAndTheKey) {
  const std::string source = train_source();
  const std::string out = dir_ + "/wider";
  std::string output;
  ASSERT_NE(train_from(source + "/model", out, &output, "--set model.hidden=48"), 0) << output;
  EXPECT_CONTAINS(output, "[train.init_from] " + source + "/model: tensor 'embed.weight' is [259, 32] there, "
                          "[259, 48] in this run's model (the model differs in: model.hidden (32 -> 48))");
  EXPECT_FALSE(fs::exists(out + "/metrics.jsonl")) << "refused before the run began";
}

TEST_F(InitFrom, AMissingPathOrAFolderWithoutAModelIsRefusedNamingTheKey) {
  std::string output;
  ASSERT_NE(train_from(dir_ + "/no-such-model", dir_ + "/a", &output), 0) << output;
  EXPECT_CONTAINS(output, "[train.init_from] '" + dir_ + "/no-such-model' does not exist");
  fs::create_directories(dir_ + "/empty");
  ASSERT_NE(train_from(dir_ + "/empty", dir_ + "/b", &output), 0) << output;
  EXPECT_CONTAINS(output, "[train.init_from] '" + dir_ + "/empty' is not a kiln model directory");
}

// A scheduler restarts every attempt with the same config and --resume: once a checkpoint
// exists, the run continues from it, and init_from (even gone by now) is not read.
TEST_F(InitFrom, AResumeFromACheckpointIgnoresIt) {
  const std::string source = train_source();
  const std::string copy = dir_ + "/copy", out = dir_ + "/continued";
  fs::copy(source + "/model", copy);
  std::string output;
  ASSERT_EQ(train_from(copy, out, &output), 0) << output;
  fs::remove_all(copy);
  ASSERT_EQ(train_from(copy, out, &output, "--set train.steps=6 --resume"), 0) << output;
  EXPECT_CONTAINS(output, "resume: train.init_from ignored, the run continues from its checkpoint");
  EXPECT_CONTAINS(output, "resumed from " + test::checkpoint_path(out, 4) + " at step 4");
  EXPECT_EQ(test::train_records(out).size(), 6u);
}

}  // namespace
}  // namespace kiln

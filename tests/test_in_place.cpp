// A conversion must not write where it reads: `kiln import hf D D` and `kiln export hf M M`
// used to exit 0 having overwritten their input. An output that is the input, lies inside
// it or contains it (symlinks resolved) is refused with one line naming both paths, before
// anything is read or written; every byte of the input is left as it was.
#include "export_fixture.h"
#include "fault_test_util.h"

#include <filesystem>
#include <map>

namespace kiln {
namespace {

namespace fs = std::filesystem;

// Every file under `root` and its bytes.
std::map<std::string, std::string> snapshot(const std::string& root) {
  std::map<std::string, std::string> files;
  for (const auto& e : fs::recursive_directory_iterator(root))
    if (e.is_regular_file()) files[e.path().string()] = test::read_file(e.path().string());
  return files;
}

TEST(InPlace, ConversionsRefuseAnOutputThatIsInsideOrAroundTheirInput) {
  const std::string dir = fs::canonical(test::temp_dir("kiln-in-place")).string();
  const std::string model = test::save_random_model(test::tiny_config(true, true, false), dir + "/model");
  const std::string hf = dir + "/hf";
  std::string output;
  ASSERT_EQ(test::run_command(test::kiln_binary() + " export hf " + model + " " + hf, &output), 0) << output;
  fs::create_directory_symlink(hf, dir + "/hf-link");
  fs::create_directory_symlink(model, dir + "/model-link");
  const auto before = snapshot(dir);

  struct Case {
    std::string args, where, output, relation, input;
  };
  const std::vector<Case> cases = {
      {"import hf " + hf + " " + hf, "import", hf, "is", hf},
      {"import hf " + hf + " " + hf + "/kiln", "import", hf + "/kiln", "lies inside", hf},
      {"import hf " + hf + " " + dir, "import", dir, "contains", hf},
      {"import hf " + hf + " " + dir + "/hf-link", "import", dir + "/hf-link", "is", hf},
      {"export hf " + model + " " + model, "export", model, "is", model},
      {"export hf " + model + " " + model + "/hf", "export", model + "/hf", "lies inside", model},
      {"export hf " + model + " " + dir, "export", dir, "contains", model},
      {"export hf " + model + " " + dir + "/model-link/", "export", dir + "/model-link/", "is", model},
      {"export gguf " + model + " " + model, "export", model, "is", model},
      {"export gguf " + model + " " + model + "/model.gguf", "export", model + "/model.gguf", "lies inside", model},
      {"export gguf " + dir + "/model-link " + model + "/model.gguf", "export", model + "/model.gguf", "lies inside",
       dir + "/model-link"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.args);
    EXPECT_EQ(test::run_command(test::kiln_binary() + " " + c.args, &output), 1) << output;
    EXPECT_EQ(std::count(output.begin(), output.end(), '\n'), 1) << output;
    EXPECT_CONTAINS(output, fmt::format("kiln: error: [{}] the output {} {} the input ", c.where, c.output, c.relation));
    EXPECT_CONTAINS(output, " the input " + c.input + ":");
  }
  EXPECT_EQ(snapshot(dir), before) << "a refused conversion changed a file";

  // Beside the input, not in it: both work.
  EXPECT_EQ(test::run_command(test::kiln_binary() + " import hf " + hf + " " + dir + "/imported", &output), 0)
      << output;
  EXPECT_EQ(test::run_command(test::kiln_binary() + " export gguf " + model + " " + dir + "/model.gguf", &output), 0)
      << output;
  fs::remove_all(dir);
}

// A run's outputs (issue 38, items 8 and 9) used to go wherever they were named: the
// metrics file over the run's config.toml, checkpoints/latest or any file outside the run
// (exit 0, the content lost), train.out_dir into the data directory (the next start read
// the run's files as data). Now refused before anything is read or written, naming the
// keys; every byte stays as it was.
TEST(InPlace, TrainRefusesOutputsOverItsOwnFilesItsInputsOrItsData) {
  const std::string dir = fs::canonical(test::temp_dir("kiln-in-place-train")).string();
  const std::string corpus = test::write_tiny_corpus(dir, 40), out = dir + "/run", data = dir + "/data";
  std::string output;
  ASSERT_EQ(test::run_command(test::tiny_train(corpus, out), &output), 0) << output;
  fs::create_directory(data);
  fs::copy_file(corpus, data + "/corpus.txt");
  test::write_file(out + "/tok.json", "a tokenizer of the user's");
  const auto before = snapshot(dir);

  struct Case {
    std::string command, error;
  };
  const std::vector<Case> cases = {
      {test::tiny_train(corpus, out, "--resume --set log.metrics_file=config.toml"),
       "[log.metrics_file] " + out + "/config.toml (log.metrics_file) is the run's config.toml (" + out +
           "/config.toml): kiln's own files are never another output"},
      {test::tiny_train(corpus, out, "--resume --set log.metrics_file=checkpoints/latest"),
       "[log.metrics_file] " + out + "/checkpoints/latest (log.metrics_file) lies inside the run's checkpoints/"},
      {test::tiny_train(corpus, out, "--resume --set log.metrics_file=../data/corpus.txt"),
       "[log.metrics_file] '../data/corpus.txt' must be a path inside train.out_dir (relative, without '..')"},
      {test::tiny_train(corpus, out, "--resume --set log.metrics_file=" + corpus),
       "[log.metrics_file] '" + corpus + "' must be a path inside train.out_dir"},
      {test::tiny_train(corpus, out, "--resume --set log.tensorboard_dir=model"),
       "[log.tensorboard_dir] " + out + "/model (log.tensorboard_dir) is the run's model/"},
      {test::tiny_train(corpus, out, "--resume --set log.metrics_file=tok.json --set data.tokenizer=" + out + "/tok.json"),
       "[log.metrics_file] " + out + "/tok.json (log.metrics_file) is data.tokenizer " + out +
           "/tok.json: writing it would destroy an input"},
      {test::tiny_train(data, data), "[train.out_dir] " + data + " is data.path " + data + ": the run would write "
                                     "among its training data; choose a train.out_dir apart from it"},
      {test::tiny_train(data, data + "/run"), "[train.out_dir] " + data + "/run lies inside data.path " + data + ":"},
      {test::tiny_train("'" + data + "/*.txt'", data + "/run"), "[train.out_dir] " + data + "/run lies inside data.path " +
                                                             data + ":"},
      {test::tiny_train(corpus, dir), "[train.out_dir] " + dir + " contains data.path " + corpus + ":"},
      {test::tiny_train(data, dir + "/other", "--set checkpoint.dir=" + data + "/checkpoints"),
       "[checkpoint.dir] " + data + "/checkpoints lies inside data.path " + data + ": checkpoints would be written "
       "among the training data"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.command);
    EXPECT_EQ(test::run_command(c.command, &output), 1) << output;
    EXPECT_EQ(std::count(output.begin(), output.end(), '\n'), 1) << output;
    EXPECT_CONTAINS(output, "kiln: error: " + c.error);
  }
  EXPECT_EQ(snapshot(dir), before) << "a refused run changed a file";
  fs::remove_all(dir);
}

// `kiln import hf X RUN_DIR` overwrote the run's config.toml, `import hf X RUN/model` the
// trained model: a destination that holds anything is refused; a new or empty one is used.
TEST(InPlace, ImportRefusesADestinationThatHoldsFiles) {
  const std::string dir = fs::canonical(test::temp_dir("kiln-in-place-import")).string();
  const std::string model = test::save_random_model(test::tiny_config(true, true, false), dir + "/model");
  const std::string hf = dir + "/hf";
  std::string output;
  ASSERT_EQ(test::run_command(test::kiln_binary() + " export hf " + model + " " + hf, &output), 0) << output;
  test::write_file(dir + "/run/config.toml", "[train]\n");
  const auto before = snapshot(dir);
  for (const std::string& destination : {model, dir + "/run"}) {
    SCOPED_TRACE(destination);
    EXPECT_EQ(test::run_command(test::kiln_binary() + " import hf " + hf + " " + destination, &output), 1) << output;
    EXPECT_EQ(std::count(output.begin(), output.end(), '\n'), 1) << output;
    EXPECT_CONTAINS(output, "kiln: error: [import] the output " + destination + " already holds files (");
    EXPECT_CONTAINS(output, "choose a new or empty directory");
  }
  EXPECT_EQ(snapshot(dir), before) << "a refused import changed a file";
  fs::create_directory(dir + "/empty");
  EXPECT_EQ(test::run_command(test::kiln_binary() + " import hf " + hf + " " + dir + "/empty", &output), 0) << output;
  EXPECT_TRUE(fs::exists(dir + "/empty/model.safetensors"));
  fs::remove_all(dir);
}

}  // namespace
}  // namespace kiln

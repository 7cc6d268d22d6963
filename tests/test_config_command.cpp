// The resolved configuration as users see it, through real `kiln` processes: `kiln config`
// prints every key described, configs/default.toml lists every key, bad keys are refused
// as `kiln train` refuses them, and a config file's paths are relative to the file.
#include "config/config_fields.h"
#include "fault_test_util.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <set>
#include <sstream>

namespace kiln {
namespace {

namespace fs = std::filesystem;

const std::string kDefaultToml = KILN_SOURCE_DIR "/configs/default.toml";

// The "section.key" of every assignment line of a TOML text written as kiln writes it
// (a "[section]" or "[[array.of.tables]]" header, then "key = value" lines); comments and
// blank lines skipped. A table of an array gives "data.sources.path".
std::set<std::string> toml_keys(const std::string& text) {
  std::set<std::string> keys;
  std::istringstream lines(text);
  std::string line, section;
  while (std::getline(lines, line)) {
    if (line.empty() || line[0] == '#' || line[0] == ' ') continue;
    if (line[0] == '[') {
      const size_t open = line.find_first_not_of('[');
      section = line.substr(open, line.find(']') - open);
      continue;
    }
    const size_t eq = line.find(" = ");
    if (eq != std::string::npos) keys.insert(section + "." + line.substr(0, eq));
  }
  return keys;
}

std::string run_ok(const std::string& command) {
  std::string output;
  EXPECT_EQ(test::run_command(command, &output), 0) << command << "\n" << output;
  return output;
}

TEST(ConfigCommand, PrintsEveryKeyWithItsDescription) {
  const std::string output = run_ok(test::kiln_binary() + " config " + kDefaultToml + " 2>&1");
  std::set<std::string> expected;
  for (const ConfigField& f : config_fields()) expected.insert(f.name());
  EXPECT_EQ(toml_keys(output), expected) << output;
  // Each key's line carries the field table's description as its comment.
  EXPECT_NE(output.find("\nlayers = 4 "), std::string::npos) << output;
  for (const ConfigField& f : config_fields())
    EXPECT_NE(output.find(fmt::format("# {}\n", f.help)), std::string::npos) << f.name();
}

TEST(ConfigCommand, AppliesSetAndItsOutputLoadsBackTheSame) {
  const std::string dir = test::temp_dir("kiln-config-cmd");
  const std::string kiln = test::kiln_binary();
  const std::string output = run_ok(kiln + " config " + kDefaultToml + " --set model.layers=3 --set optim.lr=0.01");
  EXPECT_NE(output.find("\nlayers = 3 "), std::string::npos) << output;
  EXPECT_NE(output.find("\nlr = 0.01 "), std::string::npos) << output;
  test::write_file(dir + "/resolved.toml", output);
  EXPECT_EQ(run_ok(kiln + " config " + dir + "/resolved.toml"), output);
  fs::remove_all(dir);
}

// configs/default.toml is where a new user looks for the keys there are: it must list
// every key `kiln config` resolves, and no key that is not one.
TEST(ConfigCommand, DefaultTomlListsEveryKey) {
  const std::string resolved = run_ok(test::kiln_binary() + " config " + kDefaultToml);
  EXPECT_EQ(toml_keys(test::read_file(kDefaultToml)), toml_keys(resolved));
}

// [[data.sources]] (an array of tables, not in the field table): printed after [data]'s
// keys, and the printed config loads back the same.
TEST(ConfigCommand, PrintsAMixturesSourcesAndItsOutputLoadsBackTheSame) {
  const std::string dir = test::temp_dir("kiln-config-mixture");
  const std::string kiln = test::kiln_binary();
  const std::string output = run_ok(kiln + " config " KILN_SOURCE_DIR "/configs/examples/mixture.toml");
  const std::set<std::string> keys = toml_keys(output);
  for (const char* key : {"data.sources.path", "data.sources.weight", "data.sources.name"})
    EXPECT_EQ(keys.count(key), 1u) << key << "\n" << output;
  EXPECT_NE(output.find("\n[[data.sources]]\npath = \"" KILN_SOURCE_DIR "/data/tinyshakespeare.txt\""),
            std::string::npos) << output;
  EXPECT_NE(output.find("\nweight = 4.0 "), std::string::npos) << output;
  EXPECT_NE(output.find("\npath = \"\" "), std::string::npos) << output;  // data.path gives way
  test::write_file(dir + "/resolved.toml", output);
  EXPECT_EQ(run_ok(kiln + " config " + dir + "/resolved.toml"), output);
  fs::remove_all(dir);
}

TEST(ConfigCommand, RefusesBadKeysAsTrainDoes) {
  const std::string kiln = test::kiln_binary();
  for (const std::string bad : {"--set model.layerz=3", "--set model.layers=abc", "--set model.heads=5"}) {
    std::string config_error, train_error;
    EXPECT_EQ(test::run_command(kiln + " config " + kDefaultToml + " " + bad, &config_error), 1);
    EXPECT_EQ(test::run_command(kiln + " train " + kDefaultToml + " " + bad, &train_error), 1);
    EXPECT_EQ(config_error.rfind("kiln: error: ", 0), 0u) << config_error;
    EXPECT_EQ(std::count(config_error.begin(), config_error.end(), '\n'), 1) << config_error;
    EXPECT_EQ(config_error, train_error);
  }
}

// A tiny run whose paths, all relative, are given by a config file in another directory
// than the working one.
const char* kRelativePathsToml = R"([data]
path = "corpus.txt"
val_fraction = 0.0
[model]
hidden = 32
layers = 1
heads = 2
kv_heads = 1
head_dim = 16
ffn_hidden = 64
max_seq_len = 64
[train]
out_dir = "runs/a"
micro_batch_tokens = 256
steps = 2
eval_every = 0
eval_batches = 0
sample_every = 0
sample_tokens = 0
threads = 2
[optim]
warmup_steps = 1
[log]
every = 1
plot = false
)";

TEST(ConfigPaths, AFilesPathsAreRelativeToItAndTheSavedConfigLoadsFromAnywhere) {
  const std::string dir = test::temp_dir("kiln-config-paths");
  const std::string kiln = test::kiln_binary();
  test::write_tiny_corpus(dir + "/cfg", 40);
  test::write_file(dir + "/cfg/run.toml", kRelativePathsToml);
  // Run from `dir`: corpus.txt and runs/a are found next to cfg/run.toml, not in `dir`.
  std::string output;
  ASSERT_EQ(test::run_command("cd " + dir + " && " + kiln + " train cfg/run.toml 2>&1", &output), 0) << output;
  const std::string run = dir + "/cfg/runs/a";
  EXPECT_FALSE(fs::exists(dir + "/runs"));
  // The saved config holds absolute paths, so it resumes from any working directory.
  const std::string saved = test::read_file(run + "/config.toml");
  EXPECT_NE(saved.find("path = \"" + dir + "/cfg/corpus.txt\""), std::string::npos) << saved;
  ASSERT_EQ(test::run_command("cd / && " + kiln + " train " + run + " --resume --set train.steps=3 2>&1", &output), 0)
      << output;
  EXPECT_EQ(test::steps_of(test::metrics_of_kind(run, "train")), (std::vector<int64_t>{1, 2, 3}));
  fs::remove_all(dir);
}

TEST(ConfigPaths, AMissingInputIsNamedByItsKeyAndWhereItWasLookedFor) {
  const std::string dir = test::temp_dir("kiln-config-missing");
  test::write_file(dir + "/cfg/run.toml", std::string(kRelativePathsToml) + "[eval]\ntasks = \"tasks/none.jsonl\"\n");
  test::write_tiny_corpus(dir + "/cfg", 4);
  const std::string train = "cd / && " + test::kiln_binary() + " train " + dir + "/cfg/run.toml";
  EXPECT_EQ(test::one_line_error(train + " --set data.path=nothere.txt"),
            "kiln: error: [data.path] '/nothere.txt': no such file or directory\n");
  EXPECT_EQ(test::one_line_error(train),
            "kiln: error: [eval.tasks] '" + dir + "/cfg/tasks/none.jsonl': no such file or directory\n");
  EXPECT_FALSE(fs::exists(dir + "/cfg/runs"));  // refused before anything was created
  fs::remove_all(dir);
}

// scripts/train_default.sh runs configs/default.toml from the repository root; its paths,
// relative to configs/, name the bundled corpus and runs/default from anywhere.
TEST(ConfigPaths, DefaultTomlNamesTheBundledCorpusFromAnyDirectory) {
  const std::string output = run_ok("cd / && " + test::kiln_binary() + " config " + kDefaultToml);
  const std::string root = fs::path(KILN_SOURCE_DIR).lexically_normal().string();
  EXPECT_NE(output.find("\npath = \"" + root + "/data/tinyshakespeare.txt\""), std::string::npos) << output;
  EXPECT_NE(output.find("\nout_dir = \"" + root + "/runs/default\""), std::string::npos) << output;
  EXPECT_TRUE(fs::exists(root + "/data/tinyshakespeare.txt"));
}

}  // namespace
}  // namespace kiln

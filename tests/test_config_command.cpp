// The resolved configuration as users see it, through real `kiln` processes: `kiln config`
// prints every key described, configs/default.toml lists every key, and bad keys are
// refused as `kiln train` refuses them.
#include "config/config_fields.h"
#include "test_util.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <set>
#include <sstream>

namespace kiln {
namespace {

namespace fs = std::filesystem;

const std::string kDefaultToml = KILN_SOURCE_DIR "/configs/default.toml";

// The "section.key" of every assignment line of a TOML text written as kiln writes it
// (a "[section]" header, then "key = value" lines); comments and blank lines skipped.
std::set<std::string> toml_keys(const std::string& text) {
  std::set<std::string> keys;
  std::istringstream lines(text);
  std::string line, section;
  while (std::getline(lines, line)) {
    if (line.empty() || line[0] == '#' || line[0] == ' ') continue;
    if (line[0] == '[') {
      section = line.substr(1, line.find(']') - 1);
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

}  // namespace
}  // namespace kiln

// The periodic actions' cadence keys (config/cadence_keys.h): a tokens key replaces its
// steps key's default, both given are refused naming both, and a file that lists the
// default (configs/default.toml lists every key) leaves it to give way.
#include "config/cadence_keys.h"
#include "config/config.h"
#include "test_util.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <filesystem>

using namespace kiln;
using namespace kiln::test;

#define EXPECT_HAS(haystack, needle) EXPECT_NE(std::string(haystack).find(needle), std::string::npos) << (haystack)

TEST(CadenceKeys, ATokensKeyTakesTheStepsKeysDefaultsPlace) {
  for (const CadenceKeys& k : cadence_keys()) {
    Config c = load_config("", {fmt::format("{}=5000", k.tokens_key)});
    EXPECT_EQ(k.tokens(c), 5000) << k.tokens_key;
    EXPECT_EQ(k.steps(c), 0) << k.steps_key;
    // Unset, the steps key keeps its default.
    Config d = load_config("", {}), defaults;
    EXPECT_EQ(k.steps(d), k.steps(defaults)) << k.steps_key;
  }
}

TEST(CadenceKeys, BothGivenAreRefusedNamingBoth) {
  for (const CadenceKeys& k : cadence_keys()) {
    const std::string error =
        error_of([&] { load_config("", {fmt::format("{}=7", k.steps_key), fmt::format("{}=5000", k.tokens_key)}); });
    EXPECT_HAS(error, fmt::format("[config] {} (7) and {} (5000) are mutually exclusive", k.steps_key, k.tokens_key));
  }
  // A steps key given 0 beside the tokens key is not a conflict: a resumed run's config.toml has that.
  EXPECT_NO_THROW(load_config("", {"train.sample_every=0", "train.sample_every_tokens=5000"}));
}

TEST(CadenceKeys, AFileListingTheDefaultLetsItGiveWay) {
  const std::string dir = temp_dir("kiln_cadence");
  // configs/default.toml lists sample_every = 200 and log.every = 10, its defaults.
  const Config c = load_config(source_dir() + "/configs/default.toml",
                               {"train.sample_every_tokens=4096", "log.every_tokens=1024"});
  EXPECT_EQ(c.train.sample_every, 0);
  EXPECT_EQ(c.log.every, 0);
  // A value other than the default is the user's choice: kept, and refused beside tokens.
  write_file(dir + "/c.toml", "[train]\nsample_every = 50\n");
  EXPECT_HAS(error_of([&] { load_config(dir + "/c.toml", {"train.sample_every_tokens=4096"}); }),
             "train.sample_every (50) and train.sample_every_tokens (4096) are mutually exclusive");
  std::filesystem::remove_all(dir);
}

TEST(CadenceKeys, TheLogNeedsACadence) {
  EXPECT_HAS(error_of([] { load_config("", {"log.every=0"}); }),
             "[config] log.every must be > 0, got 0 (0 only with log.every_tokens)");
  EXPECT_HAS(error_of([] { load_config("", {"log.every=-3"}); }), "log.every must be >= 0, got -3");
  EXPECT_NO_THROW(load_config("", {"log.every=0", "log.every_tokens=100"}));
}

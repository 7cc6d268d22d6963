// Shards carry their tokenizer (data/shards/shard_tokenizer.h): `kiln tokenize` copies it
// beside the manifest, and `kiln train` on the shards needs only data.path; a tokenizer or
// vocabulary given against the manifest, a mixture of shards made with different
// tokenizers and an edited tokenizer file are refused by name; shards made before keep
// working as they did.
#include "config/config.h"
#include "data_fixture.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>

namespace kiln {
namespace {

namespace fs = std::filesystem;

#define EXPECT_HAS(haystack, needle) EXPECT_NE(std::string(haystack).find(needle), std::string::npos) << (haystack)

// A BPE tokenizer and byte-level and BPE shards of one corpus, made once through the CLI.
class ShardTokenizer : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = new std::string(test::temp_dir("kiln-shard-tok"));
    const std::string& r = *root_;
    test::write_file(r + "/corpus.jsonl", test::corpus_jsonl(300, 300, 11));
    run(" train-tokenizer " + r + "/corpus.jsonl --vocab-size 300 --out " + r + "/tok");
    run(" tokenize " + r + "/corpus.jsonl -o " + r + "/bpe -q --set data.val_fraction=0.1 --set data.tokenizer=" + r +
        "/tok/tokenizer.json");
    run(" tokenize " + r + "/corpus.jsonl -o " + r + "/byte -q --set data.val_fraction=0.1");
  }
  static void TearDownTestSuite() {
    fs::remove_all(*root_);
    delete root_;
  }
  static std::string run(const std::string& args, int want = 0) {
    std::string output;
    EXPECT_EQ(test::run_command(test::kiln_binary() + args, &output), want) << args << "\n" << output;
    return output;
  }
  static nlohmann::json manifest(const std::string& dir) {
    return nlohmann::json::parse(test::read_file(dir + "/manifest.json"));
  }
  // `kiln config` of the default config on `data` with `extra` --set keys: what kiln train resolves.
  static Config resolved(const std::string& data, const std::string& extra = "") {
    const std::string toml = run(" config " KILN_SOURCE_DIR "/configs/default.toml --set data.path=" + data + extra);
    const std::string file = *root_ + "/resolved.toml";
    test::write_file(file, toml);
    return load_config(file);
  }
  static std::string* root_;
};
std::string* ShardTokenizer::root_ = nullptr;

TEST_F(ShardTokenizer, TokenizeCopiesTheTokenizerBesideTheManifest) {
  const std::string bpe = *root_ + "/bpe";
  const auto t = manifest(bpe)["tokenizer"];
  EXPECT_EQ(t["name"], "bpe");
  EXPECT_EQ(t["file"], "tokenizer.json");
  EXPECT_EQ(test::read_file(bpe + "/tokenizer.json"), test::read_file(*root_ + "/tok/tokenizer.json"));
  EXPECT_EQ(test::read_file(bpe + "/tokenizer_config.json"), test::read_file(*root_ + "/tok/tokenizer_config.json"));
  // A byte-level tokenizer needs no file: its name says it all.
  EXPECT_FALSE(manifest(*root_ + "/byte")["tokenizer"].contains("file"));
  EXPECT_FALSE(fs::exists(*root_ + "/byte/tokenizer.json"));
}

TEST_F(ShardTokenizer, TrainingOnShardsNeedsOnlyDataPath) {
  const std::string bpe = *root_ + "/bpe", out = *root_ + "/run";
  const int64_t vocab = manifest(bpe)["tokenizer"]["vocab_size"].get<int64_t>();
  ASSERT_GT(vocab, 259);  // unlike the default, so taking it is seen
  run(" train " KILN_SOURCE_DIR "/configs/default.toml --set data.path=" + bpe + " --set train.out_dir=" + out +
      " --set model.hidden=32 --set model.layers=1 --set model.heads=2 --set model.kv_heads=1 --set model.head_dim=16"
      " --set model.ffn_hidden=64 --set model.max_seq_len=128 --set train.micro_batch_tokens=512 --set train.steps=2"
      " --set train.eval_every=0 --set train.eval_batches=1 --set train.sample_every=0 --set train.sample_tokens=4"
      " --set train.threads=2 --set checkpoint.every=0");
  const Config saved = load_config(out + "/config.toml");
  EXPECT_EQ(saved.model.vocab_size, vocab);
  EXPECT_EQ(saved.data.tokenizer, bpe + "/tokenizer.json");
  EXPECT_EQ(test::read_file(out + "/model/tokenizer.json"), test::read_file(bpe + "/tokenizer.json"));
  // The run's own config.toml resumes: its tokenizer and vocabulary agree with the manifest.
  run(" config " + out + "/config.toml --set train.steps=3");
  // Byte-level shards: the defaults are theirs.
  const Config byte = resolved(*root_ + "/byte");
  EXPECT_EQ(byte.data.tokenizer, "byte");
  EXPECT_EQ(byte.model.vocab_size, 259);
}

TEST_F(ShardTokenizer, AGivenTokenizerOrVocabularyAgainstTheManifestIsRefused) {
  const std::string bpe = *root_ + "/bpe", manifest_path = bpe + "/manifest.json";
  const std::string vocab = std::to_string(manifest(bpe)["tokenizer"]["vocab_size"].get<int64_t>());
  const std::string base = " config " KILN_SOURCE_DIR "/configs/default.toml --set data.path=" + bpe;
  std::string error = run(base + " --set data.tokenizer=byte", 1);
  EXPECT_HAS(error, "kiln: error: [data.tokenizer] 'byte' (hash ");
  EXPECT_HAS(error, "is not the tokenizer of the shards in " + manifest_path + " ('bpe', vocab " + vocab);
  error = run(base + " --set model.vocab_size=259", 1);
  EXPECT_HAS(error, "kiln: error: [model.vocab_size] 259 is smaller than the vocabulary of the shards' tokenizer in " +
                        manifest_path + " (" + vocab + ")");
  // The same tokenizer given, and a vocabulary padded past it, are no conflict.
  const Config padded = resolved(bpe, " --set data.tokenizer=" + *root_ + "/tok/tokenizer.json --set model.vocab_size=512");
  EXPECT_EQ(padded.model.vocab_size, 512);
  EXPECT_EQ(padded.data.tokenizer, *root_ + "/tok/tokenizer.json");
}

TEST_F(ShardTokenizer, AnEditedTokenizerFileIsRefused) {
  const std::string dir = *root_ + "/edited";
  fs::copy(*root_ + "/bpe", dir, fs::copy_options::recursive);
  test::write_file(dir + "/tokenizer.json", test::read_file(dir + "/tokenizer.json") + " ");
  EXPECT_HAS(run(" config " KILN_SOURCE_DIR "/configs/default.toml --set data.path=" + dir, 1),
             "kiln: error: [data] " + dir + "/tokenizer.json: content hash ");
}

TEST_F(ShardTokenizer, ShardsMadeBeforeKeepWorkingAsTheyDid) {
  // A manifest without the tokenizer's file: the fingerprint does not cover it, so it reads.
  const std::string dir = *root_ + "/old";
  fs::copy(*root_ + "/bpe", dir, fs::copy_options::recursive);
  auto m = manifest(dir);
  m["tokenizer"].erase("file");
  m["tokenizer"].erase("file_hash");
  test::write_file(dir + "/manifest.json", m.dump(2));
  for (const char* f : {"tokenizer.json", "tokenizer_config.json"}) fs::remove(dir + "/" + f);
  // Its tokenizer must still be given; without it, today's error.
  const std::string train = " train " KILN_SOURCE_DIR "/configs/default.toml --set data.path=" + dir +
                            " --set train.steps=1 --set train.out_dir=" + *root_ + "/old-run";
  EXPECT_HAS(run(train, 1), "shards were made with tokenizer 'bpe'");
  // Given, it is checked, and the vocabulary comes from the manifest.
  const Config c = resolved(dir, " --set data.tokenizer=" + *root_ + "/tok/tokenizer.json");
  EXPECT_EQ(c.model.vocab_size, manifest(dir)["tokenizer"]["vocab_size"].get<int64_t>());
}

TEST_F(ShardTokenizer, AMixtureOfShardsWithDifferentTokenizersIsRefusedNamingBoth) {
  const std::string file = *root_ + "/mixture.toml";
  test::write_file(file, "[[data.sources]]\npath = \"" + *root_ + "/byte\"\nweight = 1\nname = \"b\"\n\n"
                         "[[data.sources]]\npath = \"" + *root_ + "/bpe\"\nweight = 1\n");
  const std::string error = run(" config " + file, 1);
  EXPECT_HAS(error, "kiln: error: [data.sources] data.sources[0] ('b') (" + *root_ + "/byte/manifest.json: 'byte'");
  EXPECT_HAS(error, "and data.sources[1] ('bpe') (" + *root_ + "/bpe/manifest.json: 'bpe'");
  // One tokenizer: taken as for a single shard set.
  test::write_file(file, "[[data.sources]]\npath = \"" + *root_ + "/bpe\"\nweight = 1\n\n"
                         "[[data.sources]]\npath = \"" + *root_ + "/bpe\"\nweight = 2\n");
  test::write_file(*root_ + "/resolved.toml", run(" config " + file));
  EXPECT_EQ(load_config(*root_ + "/resolved.toml").data.tokenizer, *root_ + "/bpe/tokenizer.json");
}

}  // namespace
}  // namespace kiln

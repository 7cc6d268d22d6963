// kiln shards: written by tokenize_to_shards / `kiln tokenize`, they train exactly like
// the text they came from; every shard defect is an error (strict) or a count (lenient).
// llm.c .bin and raw token files: test_shards_llmc.cpp.
#include "core/checksum.h"
#include "data/batch_stream.h"
#include "data/dataset.h"
#include "data/shards/kiln_shard.h"
#include "data/shards/manifest.h"
#include "data/tokenize.h"
#include "data/tokenizer.h"
#include "data_fixture.h"
#include "test_util.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>

namespace kiln {
namespace {

namespace fs = std::filesystem;
using test::Ids;
using test::corpus_jsonl;
using test::documents_of;
using test::expect_same_batches;
using test::make_packer;
using test::synthetic_documents;

using test::error_of;

#define EXPECT_STARTS(text, prefix) EXPECT_EQ(std::string(text).rfind(prefix, 0), 0u) << (text)

// A shard directory made from a small corpus, once per test binary.
class ShardTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = new std::string(test::temp_dir("kiln-shards"));
    test::write_file(*root_ + "/corpus.jsonl", corpus_jsonl(400, 300, 7));
    TokenizeOptions o;
    o.data.path = *root_ + "/corpus.jsonl";
    o.data.val_fraction = 0.1;
    o.out_dir = *root_ + "/pristine";
    o.shard_tokens = 12000;  // several shards
    o.chunk_bytes = 5000;    // many chunks through the reader thread
    o.threads = 2;
    report_ = new TokenizeReport(tokenize_to_shards(o, ByteTokenizer{}));
  }
  static void TearDownTestSuite() {
    fs::remove_all(*root_);
    delete root_;
    delete report_;
  }
  // A fresh copy of the pristine shards to damage.
  std::string work_copy() {
    static int copies = 0;
    const std::string dir = *root_ + "/work" + std::to_string(copies++);
    fs::copy(*root_ + "/pristine", dir, fs::copy_options::recursive);
    return dir;
  }
  static DataConfig config_for(const std::string& path, bool lenient = false) {
    DataConfig c;
    c.path = path;
    c.val_fraction = 0.1;
    c.lenient = lenient;
    return c;
  }
  static std::string* root_;
  static TokenizeReport* report_;
};
std::string* ShardTest::root_ = nullptr;
TokenizeReport* ShardTest::report_ = nullptr;

TEST_F(ShardTest, ShardsTrainExactlyLikeTheTextTheyCameFrom) {
  const Manifest& m = report_->manifest;
  EXPECT_EQ(report_->input_documents, 400u);
  EXPECT_GT(m.train.shards.size(), 3u);
  EXPECT_EQ(m.token_bytes, 2);  // vocab 259 fits uint16
  EXPECT_EQ(read_manifest(*root_ + "/pristine/manifest.json").fingerprint, m.fingerprint);

  const ByteTokenizer tok;
  const TokenDataset text(config_for(*root_ + "/corpus.jsonl"), tok);
  const TokenDataset shards(config_for(*root_ + "/pristine"), tok);
  for (const Split s : {Split::train, Split::validation}) {
    EXPECT_EQ(documents_of(shards.split(s)), documents_of(text.split(s))) << split_name(s);
    EXPECT_EQ(shards.num_tokens(s), static_cast<int64_t>(s == Split::train ? m.train.tokens : m.validation.tokens));
  }
  EXPECT_GT(shards.num_documents(Split::validation), 10);
  const Packer packer = make_packer(512, 128);
  BatchStream a(text, Split::train, packer, 5), b(shards, Split::train, packer, 5);
  expect_same_batches(a, b, 120);  // several epochs, long documents split
  const auto va = validation_batches(text, packer, 100), vb = validation_batches(shards, packer, 100);
  ASSERT_EQ(va.size(), vb.size());
  for (size_t i = 0; i < va.size(); ++i) EXPECT_EQ(va[i].tokens, vb[i].tokens);
  // The manifest path works as data.path too.
  EXPECT_EQ(TokenDataset(config_for(*root_ + "/pristine/manifest.json"), tok).num_documents(Split::train),
            shards.num_documents(Split::train));
}

TEST_F(ShardTest, RefusesToOverwriteShardsAndSingleShardFiles) {
  TokenizeOptions o;
  o.data.path = *root_ + "/corpus.jsonl";
  o.out_dir = *root_ + "/pristine";
  EXPECT_STARTS(error_of([&] { tokenize_to_shards(o, ByteTokenizer{}); }), "[tokenize] '" + o.out_dir + "' already holds");
  EXPECT_STARTS(error_of([&] { TokenDataset(config_for(*root_ + "/pristine/train_000000.kiln"), ByteTokenizer{}); }),
                "[data] '" + *root_ + "/pristine/train_000000.kiln': kiln shards are read through their manifest");
}

// Rewrites the manifest after `edit`, with a consistent fingerprint (a manifest that
// matches itself but not its shards).
template <typename Edit>
void edit_manifest(const std::string& dir, Edit edit) {
  Manifest m = read_manifest(dir + "/manifest.json");
  edit(m);
  m.fingerprint = m.compute_fingerprint();
  write_manifest(dir + "/manifest.json", m);
}

// Sets token `index` of the shard to `id` and re-hashes the shard (header and manifest),
// so only the range check can catch it.
void set_token_and_rehash(const std::string& dir, const std::string& file, uint64_t index, uint16_t id) {
  const std::string path = dir + "/" + file;
  std::string bytes = test::read_file(path);
  std::memcpy(bytes.data() + kShardHeaderBytes + 2 * index, &id, 2);
  const uint64_t hash = hash_bytes(bytes.data() + kShardHeaderBytes, bytes.size() - kShardHeaderBytes);
  std::memcpy(bytes.data() + 48, &hash, 8);
  test::write_file(path, bytes);
  edit_manifest(dir, [&](Manifest& m) {
    for (ShardInfo& s : m.train.shards)
      if (s.file == file) s.hash = hash;
  });
}

TEST_F(ShardTest, EveryShardDefectIsAnErrorOrACountedSkip) {
  struct Case {
    const char* name;
    std::function<void(const std::string& dir)> damage;
    BadInput reason;
    std::string error;  // after "[data] DIR/train_000001.kiln"
  };
  const std::string shard = "train_000001.kiln";
  auto patch = [&](const std::string& dir, size_t offset, const std::string& bytes) {
    std::string file = test::read_file(dir + "/" + shard);
    file.replace(offset, bytes.size(), bytes);
    test::write_file(dir + "/" + shard, file);
  };
  const std::vector<Case> cases = {
      {"truncated", [&](const std::string& d) {
         const std::string f = test::read_file(d + "/" + shard);
         test::write_file(d + "/" + shard, f.substr(0, f.size() - 9));
       }, BadInput::truncated, ": truncated shard: "},
      {"wrong magic", [&](const std::string& d) { patch(d, 0, "KILNSHRX"); }, BadInput::bad_header,
       ": wrong magic (not a kiln shard)"},
      {"wrong version", [&](const std::string& d) { patch(d, 8, std::string("\x02\0\0\0", 4)); }, BadInput::bad_header,
       ": shard version 2 is not supported (this kiln reads 1)"},
      {"manifest counts", [&](const std::string& d) {
         edit_manifest(d, [](Manifest& m) { m.train.shards[1].documents += 1; m.train.documents += 1; });
       }, BadInput::manifest_mismatch, ": manifest mismatch: the shard has "},
      {"corrupt content", [&](const std::string& d) { patch(d, kShardHeaderBytes + 10, "\x7f"); },
       BadInput::manifest_mismatch, ": manifest mismatch: content hashes to "},
      {"missing shard", [&](const std::string& d) { fs::remove(d + "/" + shard); }, BadInput::manifest_mismatch,
       ": shard listed in the manifest is missing"},
      {"token out of range", [&](const std::string& d) { set_token_and_rehash(d, shard, 5, 300); },
       BadInput::token_out_of_range, ":offset 74: token 300 >= vocab 259"},
  };
  const ByteTokenizer tok;
  const int64_t all_train = TokenDataset(config_for(*root_ + "/pristine"), tok).num_documents(Split::train);
  const uint64_t shard_docs = report_->manifest.train.shards[1].documents;
  for (const Case& c : cases) {
    const std::string dir = work_copy();
    c.damage(dir);
    EXPECT_STARTS(error_of([&] { TokenDataset(config_for(dir), tok); }), "[data] " + dir + "/" + shard + c.error) << c.name;
    const TokenDataset lenient(config_for(dir, true), tok);
    EXPECT_EQ(lenient.skipped().total(), 1) << c.name;
    EXPECT_EQ(lenient.skipped()[c.reason], 1) << c.name;
    // A bad token drops its document; anything else drops the shard.
    const int64_t lost = c.reason == BadInput::token_out_of_range ? 1 : static_cast<int64_t>(shard_docs);
    EXPECT_EQ(lenient.num_documents(Split::train), all_train - lost) << c.name;
  }
}

TEST_F(ShardTest, ManifestContradictionsAndTokenizerMismatchAreAlwaysErrors) {
  const ByteTokenizer tok;
  std::string dir = work_copy();
  std::string text = test::read_file(dir + "/manifest.json");
  text.replace(text.find("\"fingerprint\": \"") + 16, 4, "0000");
  test::write_file(dir + "/manifest.json", text);
  EXPECT_STARTS(error_of([&] { TokenDataset(config_for(dir, true), tok); }),
                "[data] " + dir + "/manifest.json: manifest mismatch: fingerprint ");

  dir = work_copy();
  edit_manifest(dir, [](Manifest& m) { m.tokenizer_hash ^= 1; });
  EXPECT_STARTS(error_of([&] { TokenDataset(config_for(dir, true), tok); }),
                "[data] " + dir + "/manifest.json: shards were made with tokenizer 'byte'");

  dir = work_copy();
  text = test::read_file(dir + "/manifest.json");
  text.replace(text.find("\"tokens\": "), 10, "\"tokenz\": ");
  test::write_file(dir + "/manifest.json", text);
  EXPECT_EQ(error_of([&] { TokenDataset(config_for(dir, true), tok); }),
            "[data] " + dir + "/manifest.json: splits.train.shards[0] has no member 'tokens'");
}

// Fields are read typed and range-checked, naming the field (before: nlohmann's
// "type_error.302" inside "invalid manifest (...)", or a silent conversion: a version of
// 2^32 + 1 read as an int was 1 and accepted).
TEST_F(ShardTest, ManifestFieldsOfTheWrongTypeOrRangeNameTheField) {
  const std::string dir = work_copy();
  const std::string original = test::read_file(dir + "/manifest.json");
  auto error_with = [&](const std::string& from, const std::string& to) {
    std::string text = original;
    const size_t at = text.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    text.replace(at, from.size(), to);
    test::write_file(dir + "/manifest.json", text);
    return error_of([&] { read_manifest(dir + "/manifest.json"); });
  };
  const std::string file = "[data] " + dir + "/manifest.json: ";
  EXPECT_EQ(error_with("\"version\": 1", "\"version\": 4294967297"),
            file + "manifest version 4294967297 is not supported (this kiln reads 1)");
  EXPECT_EQ(error_with("\"token_bytes\": 2", "\"token_bytes\": 4294967298"), file + "token_bytes must be 2 or 4, got 4294967298");
  EXPECT_EQ(error_with("\"vocab_size\": 259", "\"vocab_size\": \"259\""),
            file + "tokenizer.vocab_size must be a non-negative integer, got string \"259\"");
  EXPECT_EQ(error_with("\"bos_id\": 256", "\"bos_id\": 18446744073709551615"),
            file + "tokenizer.bos_id = 18446744073709551615 is out of range [-1, 2147483647]");
  EXPECT_EQ(error_with("\"malformed_json\": 0", "\"malformed_json\": -4"),
            file + "skipped.malformed_json = -4 is out of range [0, 9223372036854775807]");
}

// Shard counts whose sum wraps around 2^64 matched any split total before (unsigned
// arithmetic), so the manifest contradicted itself and still read, fingerprint and all.
TEST_F(ShardTest, ManifestTotalsThatOverflowAreRefused) {
  const std::string dir = work_copy();
  edit_manifest(dir, [](Manifest& m) {
    ASSERT_GE(m.train.shards.size(), 2u);
    m.train.shards[0].documents += uint64_t{1} << 63;
    m.train.shards[1].documents += uint64_t{1} << 63;
  });
  EXPECT_EQ(error_of([&] { read_manifest(dir + "/manifest.json"); }),
            "[data] " + dir + "/manifest.json: splits.train.shards[1].documents makes the split's total overflow 64 bits");
}

TEST_F(ShardTest, EmptyDocumentInAShardIsBadInput) {
  const std::string dir = *root_ + "/handmade";
  fs::create_directories(dir);
  const ByteTokenizer tok;
  Manifest m;
  m.tokenizer_name = tok.name();
  m.vocab_size = 259;
  m.tokenizer_hash = tokenizer_fingerprint(tok);
  m.token_bytes = 2;
  ShardWriter w(dir + "/train_000000.kiln", 2, 259, m.tokenizer_hash);
  w.add_document(Ids{1, 2, 3});
  w.add_document(Ids{});
  w.add_document(Ids{4});
  m.train.shards.push_back(w.finish());
  m.train.documents = 3;
  m.train.tokens = 4;
  m.fingerprint = m.compute_fingerprint();
  write_manifest(dir + "/manifest.json", m);
  DataConfig c = config_for(dir);
  EXPECT_EQ(error_of([&] { TokenDataset(c, tok); }),
            "[data] " + dir + "/train_000000.kiln:offset 70: empty document (no tokens)");
  c.lenient = true;
  const TokenDataset ds(c, tok);
  EXPECT_EQ(documents_of(ds.split(Split::train)), (std::vector<Ids>{{1, 2, 3}, {4}}));
  EXPECT_EQ(ds.skipped()[BadInput::empty_document], 1);
}

TEST_F(ShardTest, CliTokenizeThenTrainMatchesTrainingOnTheText) {
  const std::string out = *root_ + "/cli";
  std::string output;
  ASSERT_EQ(test::run_command(test::kiln_binary() + " tokenize " + *root_ + "/corpus.jsonl -o " + out +
                                  " --shard-tokens 20000 --set data.val_fraction=0.1 -q",
                              &output),
            0)
      << output;
  EXPECT_NE(output.find("tokenized 400 documents"), std::string::npos) << output;
  EXPECT_NE(output.find("skipped bad input: none"), std::string::npos) << output;
  auto losses = [&](const std::string& data, const std::string& run) {
    std::string log;
    const std::string cmd = test::kiln_binary() + " train " KILN_SOURCE_DIR "/configs/default.toml --set data.path=" +
                            data + " --set data.val_fraction=0.1 --set train.out_dir=" + run +
                            " --set model.hidden=32 --set model.layers=1 --set model.heads=2 --set model.kv_heads=1"
                            " --set model.head_dim=16 --set model.ffn_hidden=64 --set model.max_seq_len=128"
                            " --set train.micro_batch_tokens=512 --set train.steps=6 --set log.every=1"
                            " --set train.eval_every=0 --set train.eval_batches=2 --set train.sample_every=0"
                            " --set train.sample_tokens=4 --set train.threads=2 --set checkpoint.save_final=false"
                            " --set checkpoint.every=0";
    EXPECT_EQ(test::run_command(cmd, &log), 0) << log;
    std::vector<std::string> lines;
    for (size_t at = log.find("| loss "); at != std::string::npos; at = log.find("| loss ", at + 1))
      lines.push_back(log.substr(at, 16));
    const size_t val = log.find("validation at step");
    if (val != std::string::npos) lines.push_back(log.substr(val, 60));
    return lines;
  };
  const auto from_text = losses(*root_ + "/corpus.jsonl", *root_ + "/run-text");
  EXPECT_EQ(from_text.size(), 7u);
  EXPECT_EQ(losses(out, *root_ + "/run-shards"), from_text);
}

}  // namespace
}  // namespace kiln

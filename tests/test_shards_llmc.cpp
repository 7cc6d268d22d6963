// llm.c .bin shards and raw token files: read with their exact layouts (the test writes
// the 256 x int32 header itself), documents split at the EOT id, hash-split validation,
// data.val_path, and every bad file as an error (strict) or a counted skip (lenient).
#include "data/batch_stream.h"
#include "data/dataset.h"
#include "data/shards/llmc_bin.h"
#include "data/tokenizer.h"
#include "data_fixture.h"
#include "test_util.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <functional>

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

// ---- llm.c .bin and raw token files ------------------------------------------------------

// An llm.c file with the exact header layout: 256 int32 (magic, version, count, 0...),
// then the tokens as uint16 or uint32.
template <typename T>
void write_llmc(const std::string& path, int32_t magic, int32_t version, const std::vector<T>& tokens,
                int32_t count = -1) {
  std::string bytes(kLlmcHeaderBytes, '\0');
  const int32_t header[3] = {magic, version, count >= 0 ? count : static_cast<int32_t>(tokens.size())};
  std::memcpy(bytes.data(), header, sizeof(header));
  bytes.append(reinterpret_cast<const char*>(tokens.data()), tokens.size() * sizeof(T));
  test::write_file(path, bytes);
}

TEST(Llmc, ReadsUint16AndUint32FilesSplitAtTheEotToken) {
  const std::string dir = test::temp_dir("kiln-llmc");
  const uint16_t eot = 256;  // the byte tokenizer's BOS, data.eot_id's default
  write_llmc<uint16_t>(dir + "/shard_000000.bin", kLlmcMagicU16, kLlmcVersionU16, {eot, 1, 2, 3, eot, 4, 5, eot, 6});
  write_llmc<uint32_t>(dir + "/shard_000001.bin", kLlmcMagicU32, kLlmcVersionU32, {7, 8, eot, eot, 9});
  const ByteTokenizer tok;
  DataConfig c;
  c.path = dir + "/shard_*.bin";
  c.val_fraction = 0;
  const TokenDataset ds(c, tok);
  // The run before the first EOT of file 1 (a document llm.c cut at the shard boundary)
  // reads as its own document; empty runs are not documents.
  EXPECT_EQ(documents_of(ds.split(Split::train)), (std::vector<Ids>{{1, 2, 3}, {4, 5}, {6}, {7, 8}, {9}}));
  EXPECT_EQ(ds.num_documents(Split::validation), 0);
  c.path = dir;  // the directory: auto-detected as llm.c by the .bin extension
  EXPECT_EQ(ds.split(Split::train).fingerprint(), TokenDataset(c, tok).split(Split::train).fingerprint());
  c.eot_id = 4;  // another delimiter
  c.path = dir + "/shard_000000.bin";
  EXPECT_EQ(documents_of(TokenDataset(c, tok).split(Split::train)), (std::vector<Ids>{{256, 1, 2, 3, 256}, {5, 256, 6}}));
  fs::remove_all(dir);
}

TEST(Llmc, SplitsByTokenHashAndPacksLikeTheSameDocumentsInMemory) {
  const std::string dir = test::temp_dir("kiln-llmc");
  Rng rng(3);
  std::vector<uint16_t> tokens;
  std::vector<Ids> docs;
  for (int d = 0; d < 300; ++d) {
    tokens.push_back(256);
    Ids doc;
    for (uint64_t i = 0, n = 1 + rng.below(200); i < n; ++i) doc.push_back(static_cast<int32_t>(rng.below(256)));
    tokens.insert(tokens.end(), doc.begin(), doc.end());
    docs.push_back(doc);
  }
  write_llmc(dir + "/a.bin", kLlmcMagicU16, kLlmcVersionU16, tokens);
  DataConfig c;
  c.path = dir + "/a.bin";
  c.val_fraction = 0.2;
  const ByteTokenizer tok;
  const TokenDataset ds(c, tok);
  const auto train = documents_of(ds.split(Split::train)), val = documents_of(ds.split(Split::validation));
  EXPECT_EQ(train.size() + val.size(), 300u);
  EXPECT_GT(val.size(), 30u);
  EXPECT_LT(val.size(), 100u);
  // Same documents in memory, same order: the same batches.
  std::vector<uint64_t> ids;
  for (size_t i = 0; i < train.size(); ++i) ids.push_back(i);
  const TokenizedSplit memory = TokenizedSplit::build(ids, train);
  const Packer packer = make_packer(256, 64);
  BatchStream a(ds, Split::train, packer, 9), b(memory, packer, 9);
  expect_same_batches(a, b, 40);
  fs::remove_all(dir);
}

TEST(Llmc, BadFilesAreErrorsOrCountedSkips) {
  const std::string dir = test::temp_dir("kiln-llmc");
  const ByteTokenizer tok;
  struct Case {
    const char* name;
    std::function<void(const std::string&)> write;
    BadInput reason;
    std::string error;
    size_t good;  // documents left in lenient mode
  };
  const std::vector<uint16_t> good = {256, 1, 2, 256, 3};
  const std::vector<Case> cases = {
      {"truncated", [&](const std::string& p) { write_llmc(p, kLlmcMagicU16, kLlmcVersionU16, good, 9); },
       BadInput::truncated, ": truncated llm.c file: 1034 bytes, the header's 9 tokens of 2 bytes need 1042", 0},
      {"short header", [&](const std::string& p) { test::write_file(p, std::string(100, '\0')); }, BadInput::truncated,
       ": truncated llm.c file: 100 bytes, the header alone is 1024", 0},
      {"wrong magic", [&](const std::string& p) { write_llmc(p, 12345, 1, good); }, BadInput::bad_header,
       ": wrong magic 12345 (llm.c .bin has 20240520 or 20240801; for headerless token files set data.format = "
       "raw_u16 or raw_u32)", 0},
      {"wrong version", [&](const std::string& p) { write_llmc(p, kLlmcMagicU16, 2, good); }, BadInput::bad_header,
       ": wrong llm.c version 2 for magic 20240520 (expected 1)", 0},
      {"token out of range", [&](const std::string& p) {
         write_llmc<uint16_t>(p, kLlmcMagicU16, kLlmcVersionU16, {256, 1, 300, 256, 3});
       }, BadInput::token_out_of_range, ":offset 1028: token 300 >= vocab 259", 1},
  };
  for (const Case& k : cases) {
    const std::string path = dir + "/" + k.name + ".bin";
    k.write(path);
    DataConfig c;
    c.path = path;
    c.val_fraction = 0;
    EXPECT_EQ(error_of([&] { TokenDataset(c, tok); }), "[data] " + path + k.error) << k.name;
    // Lenient: next to a good file, the bad one (or its bad document) is skipped and counted.
    write_llmc(dir + "/good.bin", kLlmcMagicU16, kLlmcVersionU16, good);
    c.path = dir + "/*.bin";
    c.lenient = true;
    const TokenDataset ds(c, tok);
    EXPECT_EQ(ds.num_documents(Split::train), static_cast<int64_t>(2 + k.good)) << k.name;
    EXPECT_EQ(ds.skipped().total(), 1) << k.name;
    EXPECT_EQ(ds.skipped()[k.reason], 1) << k.name;
    fs::remove(path);
  }
  fs::remove_all(dir);
}

TEST(RawTokens, Uint16AndUint32FilesWithoutHeader) {
  const std::string dir = test::temp_dir("kiln-raw");
  const std::vector<uint16_t> u16 = {5, 6, 256, 7};
  const std::vector<uint32_t> u32 = {256, 8, 256, 9, 10};
  test::write_file(dir + "/a.u16", std::string(reinterpret_cast<const char*>(u16.data()), u16.size() * 2));
  test::write_file(dir + "/b.u32", std::string(reinterpret_cast<const char*>(u32.data()), u32.size() * 4));
  const ByteTokenizer tok;
  DataConfig c;
  c.val_fraction = 0;
  c.path = dir + "/a.u16";
  c.format = "raw_u16";
  EXPECT_EQ(documents_of(TokenDataset(c, tok).split(Split::train)), (std::vector<Ids>{{5, 6}, {7}}));
  c.path = dir + "/b.u32";
  c.format = "raw_u32";
  EXPECT_EQ(documents_of(TokenDataset(c, tok).split(Split::train)), (std::vector<Ids>{{8}, {9, 10}}));
  test::write_file(dir + "/c.u32", std::string(7, '\0'));
  c.path = dir + "/c.u32";
  EXPECT_EQ(error_of([&] { TokenDataset(c, tok); }),
            "[data] " + c.path + ": truncated token file: 7 bytes is not a whole number of 4-byte tokens");
  c.path = dir + "/a.u16";
  c.format = "raw_u16";
  c.eot_id = 70000;
  EXPECT_STARTS(error_of([&] { TokenDataset(c, tok); }), "[data.eot_id] 70000 is not a token id");
  fs::remove_all(dir);
}

TEST(ValPath, ValidationFromItsOwnFiles) {
  const std::string dir = test::temp_dir("kiln-valpath");
  test::write_file(dir + "/train.jsonl", corpus_jsonl(50, 40, 1));
  write_llmc<uint16_t>(dir + "/val.bin", kLlmcMagicU16, kLlmcVersionU16, {256, 1, 2, 256, 3});
  DataConfig c;
  c.path = dir + "/train.jsonl";
  c.val_path = dir + "/val.bin";
  c.val_fraction = 0.5;  // not used: val_path decides
  c.format = "auto";
  const TokenDataset ds(c, ByteTokenizer{});
  EXPECT_EQ(ds.num_documents(Split::train), 50);
  EXPECT_EQ(documents_of(ds.split(Split::validation)), (std::vector<Ids>{{1, 2}, {3}}));
  fs::remove_all(dir);
}

}  // namespace
}  // namespace kiln

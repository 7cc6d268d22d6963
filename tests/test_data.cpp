// Tokenizer and document readers: byte round trips, separators, JSONL and its errors.
#include "data/document_reader.h"
#include "data/tokenizer.h"
#include "test_util.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>

namespace kiln {
namespace {

using test::error_of;

std::vector<std::string> texts(const std::vector<Document>& docs) {
  std::vector<std::string> out;
  for (size_t i = 0; i < docs.size(); ++i) {
    EXPECT_EQ(docs[i].id, i);  // ids are the index in the file
    out.push_back(docs[i].text);
  }
  return out;
}

DataConfig config_for(const std::string& path, const std::string& format = "auto") {
  DataConfig c;
  c.path = path;
  c.format = format;
  return c;
}

TEST(ByteTokenizer, RoundTripsUtf8IncludingMultibyte) {
  ByteTokenizer tok;
  const std::string text = "h\xC3\xA9llo, \xE4\xB8\x96\xE7\x95\x8C \xF0\x9F\x99\x82\n\t\x01";  // héllo, 世界 🙂
  const std::vector<int32_t> ids = tok.encode(text);
  ASSERT_EQ(ids.size(), text.size());  // one id per byte
  EXPECT_EQ(ids[0], 'h');
  EXPECT_EQ(ids[1], 0xC3);  // bytes >= 0x80 map to 128..255, never negative
  EXPECT_EQ(ids[2], 0xA9);
  EXPECT_EQ(ids[15], 0xF0);
  for (const int32_t id : ids) EXPECT_TRUE(id >= 0 && id < 256);
  EXPECT_EQ(tok.decode(ids), text);
  EXPECT_TRUE(tok.encode("").empty());
}

TEST(ByteTokenizer, SpecialIdsAndDecodeSkipsThem) {
  ByteTokenizer tok;
  EXPECT_EQ(tok.vocab_size(), 259);
  EXPECT_EQ(tok.bos_id(), 256);
  EXPECT_EQ(tok.eos_id(), 257);
  EXPECT_EQ(tok.pad_id(), 258);
  EXPECT_EQ(tok.name(), "byte");
  const std::vector<int32_t> ids = {256, 'h', 'i', 257, 258, 258};
  EXPECT_EQ(tok.decode(ids), "hi");
  const std::vector<int32_t> bad = {'a', 259};
  EXPECT_NE(error_of([&] { tok.decode(bad); }).find("[data.tokenizer] id 259"), std::string::npos);
}

TEST(TokenizerRegistry, MakesByteAndRejectsUnknownNames) {
  const auto tok = make_tokenizer("byte");
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->name(), "byte");
  EXPECT_EQ(tok->vocab_size(), 259);
  // Other tokenizers register too (BPE); the list is sorted and names every one.
  const std::string e = error_of([] { make_tokenizer("nonesuch"); });
  EXPECT_EQ(e.rfind("[data.tokenizer] unknown tokenizer 'nonesuch' (known: ", 0), 0u) << e;
  EXPECT_NE(e.find("byte"), std::string::npos) << e;
  const std::vector<std::string> names = tokenizer_names();
  EXPECT_TRUE(std::is_sorted(names.begin(), names.end()));
  EXPECT_NE(std::find(names.begin(), names.end(), "byte"), names.end());
}

TEST(TextReader, SplitsOnSeparatorKeepsTextAndSkipsBlankPieces) {
  const std::string dir = test::temp_dir("kiln-data");
  const std::string path = dir + "/corpus.txt";
  test::write_file(path, "\n\nFirst doc\nline two\n\nsecond\n\n\n\nthird  \n\n\nfourth\n\n \n\n");
  const auto docs = read_documents(config_for(path));
  // "\n\n\n" splits as "" + "\n..."; the leading newline is part of the text.
  EXPECT_EQ(texts(docs), (std::vector<std::string>{"First doc\nline two", "second", "third  ", "\nfourth"}));
  std::filesystem::remove_all(dir);
}

TEST(TextReader, CustomSeparatorAndForcedFormat) {
  const std::string dir = test::temp_dir("kiln-data");
  const std::string path = dir + "/corpus.jsonl";  // name says jsonl, format says text
  test::write_file(path, "alpha\n\nstill alpha<|end|>beta<|end|><|end|>gamma");
  DataConfig c = config_for(path, "text");
  c.doc_separator = "<|end|>";
  EXPECT_EQ(texts(read_documents(c)), (std::vector<std::string>{"alpha\n\nstill alpha", "beta", "gamma"}));
  std::filesystem::remove_all(dir);
}

TEST(TextReader, Errors) {
  const std::string dir = test::temp_dir("kiln-data");
  const std::string missing = dir + "/nope.txt";
  EXPECT_EQ(error_of([&] { read_documents(config_for(missing)); }), "[data] cannot open '" + missing + "'");
  const std::string empty = dir + "/empty.txt";
  test::write_file(empty, "");
  EXPECT_EQ(error_of([&] { read_documents(config_for(empty)); }), "[data] '" + empty + "' contains no documents");
  const std::string blank = dir + "/blank.txt";
  test::write_file(blank, "\n\n \n\n\t\n");
  EXPECT_EQ(error_of([&] { read_documents(config_for(blank)); }), "[data] '" + blank + "' contains no documents");
  EXPECT_EQ(error_of([&] { read_documents(config_for(blank, "csv")); }),
            "[data.format] unknown format 'csv' (known: auto|text|jsonl|parquet|arrow|shards|llmc|raw_u16|raw_u32)");
  DataConfig no_sep = config_for(blank);
  no_sep.doc_separator = "";
  EXPECT_EQ(error_of([&] { read_documents(no_sep); }), "[data.doc_separator] must not be empty");
  std::filesystem::remove_all(dir);
}

TEST(FormatDetection, AutoPicksByExtension) {
  EXPECT_EQ(resolve_format(config_for("a/b.jsonl")), "jsonl");
  EXPECT_EQ(resolve_format(config_for("a/b.JSON")), "jsonl");
  EXPECT_EQ(resolve_format(config_for("a/b.txt")), "text");
  EXPECT_EQ(resolve_format(config_for("a/jsonl")), "text");
  EXPECT_EQ(resolve_format(config_for("a/b.jsonl", "text")), "text");
}

TEST(JsonlReader, ReadsTextFieldSkipsBlankLinesButNotEmptyDocuments) {
  const std::string dir = test::temp_dir("kiln-data");
  const std::string path = dir + "/corpus.jsonl";
  test::write_file(path,
                   "{\"text\": \"one\\ntwo\", \"meta\": 1}\n"
                   "\n"
                   "   \r\n"
                   "{\"id\": 7, \"text\": \"caf\\u00e9 \xF0\x9F\x99\x82\"}\r\n"
                   "{\"text\": \"last, no newline\"}");
  EXPECT_EQ(texts(read_documents(config_for(path))),
            (std::vector<std::string>{"one\ntwo", "caf\xC3\xA9 \xF0\x9F\x99\x82", "last, no newline"}));
  // An empty document is bad input (test_data_readers.cpp covers the lenient count).
  test::write_file(path, "{\"text\": \"a\"}\n{\"text\": \"\"}\n");
  EXPECT_EQ(error_of([&] { read_documents(config_for(path)); }),
            "[data] " + path + ":2: empty document (field 'text' is \"\")");

  const std::string custom = dir + "/custom.json";
  test::write_file(custom, "{\"body\": \"x\"}\n{\"body\": \"y\", \"text\": 3}\n");
  DataConfig c = config_for(custom);
  c.text_key = "body";
  EXPECT_EQ(texts(read_documents(c)), (std::vector<std::string>{"x", "y"}));
  std::filesystem::remove_all(dir);
}

TEST(JsonlReader, ErrorsNameFileAndLine) {
  const std::string dir = test::temp_dir("kiln-data");
  const std::string path = dir + "/bad.jsonl";
  auto error_for = [&](const std::string& contents) {
    test::write_file(path, contents);
    return error_of([&] { read_documents(config_for(path)); });
  };
  const std::string good = "{\"text\": \"fine\"}\n";

  const std::string malformed = error_for(good + "\n{\"text\": \"unterminated}\n" + good);
  EXPECT_EQ(malformed.rfind("[data] " + path + ":3: malformed JSON (", 0), 0u) << malformed;
  EXPECT_EQ(malformed.back(), ')');
  EXPECT_EQ(malformed.find('\n'), std::string::npos);  // one line
  EXPECT_EQ(malformed.find("json.exception"), std::string::npos);

  const std::string trailing = error_for(good + "{\"text\": \"a\"} extra\n");
  EXPECT_EQ(trailing.rfind("[data] " + path + ":2: malformed JSON (", 0), 0u) << trailing;

  EXPECT_EQ(error_for(good + "{\"body\": \"x\"}\n"), "[data] " + path + ":2: missing string field 'text'");
  EXPECT_EQ(error_for(good + good + "{\"text\": 5}\n"), "[data] " + path + ":3: missing string field 'text'");
  EXPECT_EQ(error_for("{\"text\": null}\n"), "[data] " + path + ":1: missing string field 'text'");
  EXPECT_EQ(error_for("[\"text\"]\n"), "[data] " + path + ":1: missing string field 'text'");
  EXPECT_EQ(error_for("\"text\"\n"), "[data] " + path + ":1: missing string field 'text'");
  EXPECT_EQ(error_for(""), "[data] '" + path + "' contains no documents");
  EXPECT_EQ(error_for("\n  \n\n"), "[data] '" + path + "' contains no documents");
  const std::string missing = dir + "/missing.jsonl";
  EXPECT_EQ(error_of([&] { read_documents(config_for(missing)); }), "[data] cannot open '" + missing + "'");
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kiln

// Readers: compressed files (.zst, .gz), directories and globs, streaming splits across
// read chunks, UTF-8 validation, and every text-side bad input in strict and lenient mode.
#include "data/bad_input.h"
#include "data/data_format.h"
#include "data/dataset.h"
#include "data/document_reader.h"
#include "data/readers/compressed.h"
#include "data/readers/glob.h"
#include "core/utf8.h"
#include "data/tokenizer.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <zlib.h>
#include <zstd.h>

#include <filesystem>

namespace kiln {
namespace {

namespace fs = std::filesystem;

using test::error_of;

// Starts with `prefix` (messages end with library-specific detail).
#define EXPECT_STARTS(text, prefix) EXPECT_EQ(std::string(text).rfind(prefix, 0), 0u) << (text)

std::vector<std::string> texts(const std::vector<Document>& docs) {
  std::vector<std::string> out;
  for (size_t i = 0; i < docs.size(); ++i) {
    EXPECT_EQ(docs[i].id, i);  // ids number the documents of the whole source
    out.push_back(docs[i].text);
  }
  return out;
}

DataConfig config_for(const std::string& path, bool lenient = false) {
  DataConfig c;
  c.path = path;
  c.lenient = lenient;
  return c;
}

// zstd: each piece its own frame (a multi-frame file, as pzstd writes).
void write_zstd(const std::string& path, const std::vector<std::string>& frames) {
  std::string out;
  for (const std::string& f : frames) {
    std::string buf(ZSTD_compressBound(f.size()), '\0');
    const size_t n = ZSTD_compress(buf.data(), buf.size(), f.data(), f.size(), 3);
    ASSERT_FALSE(ZSTD_isError(n));
    out.append(buf.data(), n);
  }
  test::write_file(path, out);
}

// gzip: each piece its own member (as `cat a.gz b.gz` makes).
void write_gzip(const std::string& path, const std::vector<std::string>& members) {
  fs::remove(path);
  for (const std::string& m : members) {
    gzFile f = gzopen(path.c_str(), "ab");
    ASSERT_NE(f, nullptr);
    ASSERT_EQ(gzwrite(f, m.data(), static_cast<unsigned>(m.size())), static_cast<int>(m.size()));
    gzclose(f);
  }
}

const std::string kJsonl = "{\"text\": \"alpha\"}\n{\"text\": \"beta\\ngamma\"}\n\n{\"text\": \"delta\"}\n";

TEST(Compressed, ZstdAndGzipReadLikePlainFilesAcrossFramesAndMembers) {
  const std::string dir = test::temp_dir("kiln-readers");
  test::write_file(dir + "/plain.jsonl", kJsonl);
  write_zstd(dir + "/z.jsonl.zst", {kJsonl.substr(0, 20), kJsonl.substr(20)});
  write_gzip(dir + "/g.jsonl.gz", {kJsonl.substr(0, 7), kJsonl.substr(7)});
  const auto expected = std::vector<std::string>{"alpha", "beta\ngamma", "delta"};
  for (const char* name : {"/plain.jsonl", "/z.jsonl.zst", "/g.jsonl.gz"}) {
    EXPECT_EQ(resolve_format(config_for(dir + name)), "jsonl") << name;  // the inner extension decides
    EXPECT_EQ(texts(read_documents(config_for(dir + name))), expected) << name;
  }
  // Text files compress the same way.
  write_zstd(dir + "/t.txt.zst", {"one\n\ntw", "o\n\nthree"});
  EXPECT_EQ(texts(read_documents(config_for(dir + "/t.txt.zst"))), (std::vector<std::string>{"one", "two", "three"}));
  EXPECT_EQ(read_all_bytes(dir + "/g.jsonl.gz"), kJsonl);
  fs::remove_all(dir);
}

TEST(Compressed, TruncatedStreamIsAnErrorOrACountedSkip) {
  const std::string dir = test::temp_dir("kiln-readers");
  std::string big;
  // Large enough for several zstd blocks (128 KiB each): what precedes the cut decodes.
  for (int i = 0; i < 20000; ++i) big += "{\"text\": \"document number " + std::to_string(i) + "\"}\n";
  write_zstd(dir + "/a.jsonl.zst", {big});
  write_gzip(dir + "/b.jsonl.gz", {big});
  for (const char* name : {"/a.jsonl.zst", "/b.jsonl.gz"}) {
    const std::string path = dir + name;
    std::string bytes = test::read_file(path);
    test::write_file(path, bytes.substr(0, bytes.size() * 2 / 3));  // cut mid-stream
    const std::string e = error_of([&] { read_documents(config_for(path)); });
    EXPECT_STARTS(e, "[data] " + path + ": ");
    EXPECT_TRUE(e.find("ends mid-") != std::string::npos || e.find("corrupt") != std::string::npos) << e;

    BadInputLog log(true);
    const auto docs = read_documents(config_for(path, true), log);
    EXPECT_GT(docs.size(), 100u);   // what came before the cut
    EXPECT_LT(docs.size(), 20000u);  // and not the partial tail
    EXPECT_EQ(docs.back().text, "document number " + std::to_string(docs.size() - 1));
    EXPECT_EQ(log.counts()[BadInput::truncated], 1);
  }
  fs::remove_all(dir);
}

TEST(Paths, DirectoriesAndGlobsReadSortedFilesAsOneSequence) {
  const std::string dir = test::temp_dir("kiln-readers");
  test::write_file(dir + "/b/2.txt", "b2 first\n\nb2 second");
  test::write_file(dir + "/a.jsonl", "{\"text\": \"a1\"}\n");
  test::write_file(dir + "/b/1.txt.gz", "");  // replaced below by a real gzip file
  write_gzip(dir + "/b/1.txt.gz", {"b1"});
  test::write_file(dir + "/.hidden.txt", "never read");
  test::write_file(dir + "/.git/x.txt", "never read");
  EXPECT_EQ(expand_data_path(dir), (std::vector<std::string>{dir + "/a.jsonl", dir + "/b/1.txt.gz", dir + "/b/2.txt"}));
  // Each file by its own extension; ids count across files.
  EXPECT_EQ(texts(read_documents(config_for(dir))), (std::vector<std::string>{"a1", "b1", "b2 first", "b2 second"}));
  EXPECT_EQ(texts(read_documents(config_for(dir + "/b/*.txt*"))), (std::vector<std::string>{"b1", "b2 first", "b2 second"}));
  EXPECT_EQ(resolve_format(config_for(dir + "/*.jsonl")), "jsonl");
  EXPECT_EQ(error_of([&] { read_documents(config_for(dir + "/*.csv")); }), "[data] '" + dir + "/*.csv' matches no files");
  const std::string empty = dir + "/empty";
  fs::create_directories(empty);
  EXPECT_EQ(error_of([&] { read_documents(config_for(empty)); }), "[data] directory '" + empty + "' contains no files");
  // Token files cannot mix with text.
  test::write_file(dir + "/b/x.bin", "");
  EXPECT_STARTS(error_of([&] { resolve_format(config_for(dir)); }), "[data.format] '" + dir + "' mixes");
  fs::remove_all(dir);
}

TEST(Paths, FormatsByExtension) {
  EXPECT_EQ(format_of_file("a/b.jsonl.zst"), DataFormat::jsonl);
  EXPECT_EQ(format_of_file("a/b.JSON.gz"), DataFormat::jsonl);
  EXPECT_EQ(format_of_file("a/b.txt.zst"), DataFormat::text);
  EXPECT_EQ(format_of_file("a/train_000001.bin"), DataFormat::llmc);
  EXPECT_EQ(format_of_file("a/manifest.json"), DataFormat::shards);
  EXPECT_EQ(format_of_file("a/my_manifest.json"), DataFormat::jsonl);
  EXPECT_EQ(resolve_data_format("x.txt", "raw_u16"), DataFormat::raw_u16);
  EXPECT_EQ(resolve_data_format("x.jsonl", "shards"), DataFormat::shards);
}

TEST(Streaming, SplitsMatchTheWholeFileAcrossReadChunks) {
  // Documents and separators straddle the reader's 1 MiB chunks; the pieces must be those
  // of splitting the whole file at once.
  const std::string dir = test::temp_dir("kiln-readers");
  Rng rng(11);
  std::string all;
  std::vector<std::string> expected;
  while (all.size() < (size_t{3} << 20)) {
    std::string doc;
    const size_t len = 1 + rng.below(rng.below(10) == 0 ? 400000 : 3000);
    for (size_t i = 0; i < len; ++i) doc.push_back(static_cast<char>('a' + rng.below(26)));
    if (rng.below(7) == 0) doc += "\n";  // a lone newline inside: not a separator
    expected.push_back(doc);
    all += doc + "<SEP>";
  }
  test::write_file(dir + "/big.txt", all);
  DataConfig c = config_for(dir + "/big.txt");
  c.doc_separator = "<SEP>";
  EXPECT_EQ(texts(read_documents(c)), expected);
  fs::remove_all(dir);
}

TEST(Utf8, ValidatorFollowsRfc3629) {
  EXPECT_TRUE(is_valid_utf8(""));
  EXPECT_TRUE(is_valid_utf8("plain ascii, long enough for the eight-byte path"));
  EXPECT_TRUE(is_valid_utf8("h\xC3\xA9llo \xE4\xB8\x96\xE7\x95\x8C \xF0\x9F\x99\x82 \xF4\x8F\xBF\xBF"));
  EXPECT_EQ(find_invalid_utf8("abc\xFF"), 3u);
  EXPECT_EQ(find_invalid_utf8("abcdefghij\x80"), 10u);        // lone continuation byte
  EXPECT_EQ(find_invalid_utf8("\xC0\xAF"), 0u);               // overlong '/'
  EXPECT_EQ(find_invalid_utf8("ok\xE0\x80\xAF"), 2u);         // overlong 3-byte
  EXPECT_EQ(find_invalid_utf8("\xED\xA0\x80"), 0u);           // UTF-16 surrogate
  EXPECT_EQ(find_invalid_utf8("\xF4\x90\x80\x80"), 0u);       // above U+10FFFF
  EXPECT_EQ(find_invalid_utf8("x\xE4\xB8"), 1u);              // truncated sequence
  EXPECT_EQ(find_invalid_utf8("\xC3\xA9\xC3"), 2u);
}

// ---- bad input: strict errors and lenient counts --------------------------------------

struct BadCase {
  const char* name;
  const char* file;      // file name (its extension picks the reader)
  std::string contents;  // one bad unit among good ones
  BadInput reason;
  std::string error;     // the strict error after "[data] PATH"
  size_t good;           // documents a lenient read keeps
};

TEST(BadInput, EachReasonIsAnErrorInStrictModeAndACountInLenientMode) {
  const std::string dir = test::temp_dir("kiln-readers");
  const std::string ok = "{\"text\": \"fine\"}\n";
  const std::vector<BadCase> cases = {
      {"malformed JSON", "a.jsonl", ok + "{\"text\": \"unterminated}\n" + ok, BadInput::malformed_json,
       ":2: malformed JSON (", 2},
      {"not an object", "b.jsonl", ok + ok + "[1, 2]\n", BadInput::missing_text_key, ":3: missing string field 'text'", 2},
      {"missing key", "c.jsonl", "{\"body\": \"x\"}\n" + ok, BadInput::missing_text_key,
       ":1: missing string field 'text'", 1},
      {"empty document", "d.jsonl", ok + "{\"text\": \"\"}\n", BadInput::empty_document,
       ":2: empty document (field 'text' is \"\")", 1},
      {"invalid UTF-8 in JSONL", "e.jsonl", ok + "{\"text\": \"caf\xE9\"}\n" + ok, BadInput::invalid_utf8,
       ":2: invalid UTF-8 (byte 0xe9 at column 14)", 2},
      {"invalid UTF-8 in text", "f.txt", "first\n\nsecond line\nbad \xFF here\n\nthird", BadInput::invalid_utf8,
       ":4: invalid UTF-8 (byte 0xff)", 2},
  };
  for (const BadCase& c : cases) {
    const std::string path = dir + "/" + c.file;
    test::write_file(path, c.contents);
    const std::string e = error_of([&] { read_documents(config_for(path)); });
    EXPECT_STARTS(e, "[data] " + path + c.error) << c.name;
    EXPECT_EQ(e.find('\n'), std::string::npos) << c.name;  // one line

    BadInputLog log(true);
    EXPECT_EQ(read_documents(config_for(path, true), log).size(), c.good) << c.name;
    const BadInputCounts counts = log.counts();
    EXPECT_EQ(counts.total(), 1) << c.name;
    EXPECT_EQ(counts[c.reason], 1) << c.name;
    EXPECT_EQ(log.first(c.reason).rfind(path + ":", 0), 0u) << c.name;
  }
  fs::remove_all(dir);
}

TEST(BadInput, LenientDatasetReportsCountsPerReason) {
  const std::string dir = test::temp_dir("kiln-readers");
  std::string jsonl;
  for (int i = 0; i < 200; ++i) jsonl += "{\"text\": \"document " + std::to_string(i) + "\"}\n";
  jsonl += "{oops\n{\"text\": \"\"}\n{\"text\": \"\"}\n{\"x\": 1}\n{\"text\": \"\xC3\"}\n";
  test::write_file(dir + "/c.jsonl", jsonl);
  DataConfig c = config_for(dir + "/c.jsonl", true);
  c.val_fraction = 0.1;
  const TokenDataset ds(c, ByteTokenizer{});
  EXPECT_EQ(ds.num_documents(Split::train) + ds.num_documents(Split::validation), 200);
  EXPECT_EQ(ds.skipped().total(), 5);
  EXPECT_EQ(ds.skipped()[BadInput::empty_document], 2);
  EXPECT_EQ(ds.skipped().summary(), "1 malformed JSON, 1 invalid UTF-8, 1 missing text key, 2 empty document");
  EXPECT_EQ(ds.skipped_summary().find("1 malformed JSON (first at " + dir + "/c.jsonl:201)"), 0u) << ds.skipped_summary();
  // Strict (the default): the first bad line stops the read.
  c.lenient = false;
  EXPECT_STARTS(error_of([&] { TokenDataset(c, ByteTokenizer{}); }), "[data] " + dir + "/c.jsonl:201: malformed JSON");
  fs::remove_all(dir);
}

TEST(BadInput, CountsSummaryAndMerge) {
  BadInputLog a(true), b(true);
  a.report(BadInput::truncated, "x.zst", "cut");
  b.report(BadInput::truncated, "y.zst", "cut");
  b.report(BadInput::bad_header, "y.bin", "magic");
  a.merge(b);
  EXPECT_EQ(a.counts()[BadInput::truncated], 2);
  EXPECT_EQ(a.first(BadInput::truncated), "x.zst");
  EXPECT_EQ(a.first(BadInput::bad_header), "y.bin");
  EXPECT_EQ(a.counts().summary(), "2 truncated file, 1 wrong magic or version");
  EXPECT_EQ(BadInputCounts{}.summary(), "none");
  BadInputLog strict;
  EXPECT_EQ(error_of([&] { strict.report(BadInput::token_out_of_range, "s.kiln:offset 64", "token 9 >= vocab 8"); }),
            "[data] s.kiln:offset 64: token 9 >= vocab 8");
}

}  // namespace
}  // namespace kiln

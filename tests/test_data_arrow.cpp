// Parquet files and Hugging Face `save_to_disk` folders (Arrow IPC streams) as training
// data: the same documents as the equivalent JSONL, through data.path, directories,
// globs and data.sources; the errors for a missing or non-string text column, a null
// row (strict and lenient) and a DatasetDict folder; and a `kiln train` run on Parquet.
// The fixtures are written with Arrow C++ itself (the library kiln reads them with), and
// once with pyarrow from the tests' Python environment.
#include "data/data_format.h"
#include "data/dataset.h"
#include "data/document_reader.h"
#include "data/tokenizer.h"
#include "data_fixture.h"
#include "fault_test_util.h"
#include "test_util.h"

#include <arrow/api.h>
#include <arrow/io/file.h>
#include <arrow/ipc/writer.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <parquet/arrow/writer.h>

#include <filesystem>
#include <optional>

namespace kiln {
namespace {

namespace fs = std::filesystem;

using test::error_of;
using Rows = std::vector<std::optional<std::string>>;  // nullopt: a null

// Documents that JSON must escape and byte tokenizers split: quotes, newlines, tabs,
// backslashes, multi-byte UTF-8; and enough of them for several row groups and batches.
std::vector<std::string> tricky_documents(int n) {
  std::vector<std::string> out;
  out.push_back("plain text");
  out.push_back("two\nlines and a \"quote\"\tand a tab \\ backslash");
  out.push_back("caf\xc3\xa9 \xe6\x97\xa5\xe6\x9c\xac \xf0\x9f\x94\xa5");
  for (const Document& d : test::synthetic_documents(n - 3, 80, 7)) out.push_back(d.text);
  return out;
}

std::shared_ptr<arrow::Table> table_of(const Rows& rows, const std::string& column = "text") {
  arrow::StringBuilder text;
  arrow::Int64Builder id;
  for (size_t i = 0; i < rows.size(); ++i) {
    EXPECT_TRUE((rows[i] ? text.Append(*rows[i]) : text.AppendNull()).ok());
    EXPECT_TRUE(id.Append(static_cast<int64_t>(i)).ok());
  }
  // The text column second, after another: kiln must find it by name.
  auto schema = arrow::schema({arrow::field("id", arrow::int64()), arrow::field(column, arrow::utf8())});
  return arrow::Table::Make(schema, {*id.Finish(), *text.Finish()});
}

Rows rows_of(const std::vector<std::string>& docs) { return Rows(docs.begin(), docs.end()); }

void write_parquet(const std::string& path, const std::shared_ptr<arrow::Table>& table, int64_t rows_per_group) {
  auto out = arrow::io::FileOutputStream::Open(path);
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  const arrow::Status written = parquet::arrow::WriteTable(*table, arrow::default_memory_pool(), *out, rows_per_group);
  ASSERT_TRUE(written.ok()) << written.ToString();
  ASSERT_TRUE((*out)->Close().ok());
}

// An Arrow IPC stream of `rows_per_batch`-row batches, as datasets writes its shards.
void write_arrow_stream(const std::string& path, const std::shared_ptr<arrow::Table>& table, int64_t rows_per_batch) {
  auto out = arrow::io::FileOutputStream::Open(path);
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  auto writer = arrow::ipc::MakeStreamWriter(*out, table->schema());
  ASSERT_TRUE(writer.ok()) << writer.status().ToString();
  ASSERT_TRUE((*writer)->WriteTable(*table, rows_per_batch).ok());
  ASSERT_TRUE((*writer)->Close().ok());
  ASSERT_TRUE((*out)->Close().ok());
}

// A folder as Dataset.save_to_disk writes it: dataset_info.json, state.json naming the
// shards, and the shards (data-0000i-of-0000n.arrow), the documents split between them.
void write_saved_dataset(const std::string& dir, const std::vector<std::string>& docs, int shards) {
  fs::create_directories(dir);
  test::write_file(dir + "/dataset_info.json",
                   R"({"citation": "", "description": "", "features": {"id": {"dtype": "int64", "_type": "Value"},)"
                   R"( "text": {"dtype": "string", "_type": "Value"}}, "homepage": "", "license": ""})");
  nlohmann::json state = {{"_fingerprint", "0123456789abcdef"}, {"_format_columns", nullptr}, {"_format_kwargs", {}},
                          {"_format_type", nullptr}, {"_output_all_columns", false}, {"_split", nullptr}};
  state["_data_files"] = nlohmann::json::array();
  const size_t per_shard = (docs.size() + static_cast<size_t>(shards) - 1) / static_cast<size_t>(shards);
  for (int s = 0; s < shards; ++s) {
    const std::string name = fmt::format("data-{:05d}-of-{:05d}.arrow", s, shards);
    const size_t begin = std::min(docs.size(), per_shard * static_cast<size_t>(s));
    const size_t end = std::min(docs.size(), begin + per_shard);
    write_arrow_stream(dir + "/" + name, table_of(Rows(docs.begin() + begin, docs.begin() + end)), 10);
    state["_data_files"].push_back({{"filename", name}});
  }
  test::write_file(dir + "/state.json", state.dump(2));
}

void write_jsonl(const std::string& path, const std::vector<std::string>& docs) {
  std::string out;
  for (const std::string& d : docs) out += nlohmann::json{{"text", d}}.dump() + "\n";
  test::write_file(path, out);
}

DataConfig config_for(const std::string& path, bool lenient = false) {
  DataConfig c;
  c.path = path;
  c.lenient = lenient;
  return c;
}

std::vector<std::string> texts_of(const std::vector<Document>& docs) {
  std::vector<std::string> out;
  for (size_t i = 0; i < docs.size(); ++i) {
    EXPECT_EQ(docs[i].id, i);
    out.push_back(docs[i].text);
  }
  return out;
}

// The same documents, ids and train/validation token splits as the JSONL at `jsonl`.
void expect_same_as_jsonl(const std::string& path, const std::string& jsonl) {
  EXPECT_EQ(texts_of(read_documents(config_for(path))), texts_of(read_documents(config_for(jsonl))));
  ByteTokenizer tokenizer;
  DataConfig a = config_for(path), b = config_for(jsonl);
  a.val_fraction = b.val_fraction = 0.2;
  const TokenDataset from_arrow(a, tokenizer), from_jsonl(b, tokenizer);
  for (const Split s : {Split::train, Split::validation}) {
    EXPECT_GT(from_jsonl.split(s).num_documents(), 0);
    EXPECT_EQ(test::documents_of(from_arrow.split(s)), test::documents_of(from_jsonl.split(s)));
  }
}

TEST(DataArrow, ParquetReadsTheSameDocumentsAsJsonl) {
  const std::string dir = test::temp_dir("kiln-data-parquet");
  const std::vector<std::string> docs = tricky_documents(40);
  write_parquet(dir + "/corpus.parquet", table_of(rows_of(docs)), 7);  // 6 row groups
  write_jsonl(dir + "/corpus.jsonl", docs);
  EXPECT_EQ(resolve_format(config_for(dir + "/corpus.parquet")), "parquet");
  expect_same_as_jsonl(dir + "/corpus.parquet", dir + "/corpus.jsonl");
  fs::remove_all(dir);
}

// Files written by pyarrow (the pinned wheel in the tests' Python environment), not by the
// Arrow C++ this test links: what a user's datasets and pandas tooling writes.
TEST(DataArrow, FilesWrittenByPyarrowReadTheSameDocumentsAsJsonl) {
  const std::string dir = test::temp_dir("kiln-data-pyarrow");
  const std::vector<std::string> docs = tricky_documents(23);
  test::write_file(dir + "/docs.json", nlohmann::json(docs).dump());
  std::string output;
  ASSERT_EQ(test::run_command(test::kiln_python() + " " KILN_SOURCE_DIR "/tests/python/write_arrow_files.py " + dir +
                                  "/docs.json " + dir,
                              &output),
            0)
      << output;
  write_jsonl(dir + "/corpus.jsonl", docs);
  expect_same_as_jsonl(dir + "/corpus.parquet", dir + "/corpus.jsonl");
  expect_same_as_jsonl(dir + "/corpus.arrow", dir + "/corpus.jsonl");
  fs::remove_all(dir);
}

TEST(DataArrow, SaveToDiskFolderReadsTheSameDocumentsAsJsonl) {
  const std::string dir = test::temp_dir("kiln-data-save-to-disk");
  const std::vector<std::string> docs = tricky_documents(45);
  write_saved_dataset(dir + "/saved", docs, 2);
  write_jsonl(dir + "/corpus.jsonl", docs);
  // Its JSON metadata is not read as JSONL documents.
  EXPECT_EQ(resolve_format(config_for(dir + "/saved")), "arrow");
  expect_same_as_jsonl(dir + "/saved", dir + "/corpus.jsonl");
  // One shard by itself, as a file.
  const std::vector<Document> shard = read_documents(config_for(dir + "/saved/data-00001-of-00002.arrow"));
  ASSERT_EQ(shard.size(), docs.size() - 23);
  EXPECT_EQ(shard.front().text, docs[23]);
  fs::remove_all(dir);
}

// A directory and a glob read Parquet and .arrow files beside JSONL, each by its extension,
// in path order; a save_to_disk folder below a directory gives its shards only.
TEST(DataArrow, DirectoriesAndGlobsMixParquetArrowAndJsonl) {
  const std::string dir = test::temp_dir("kiln-data-arrow-mix");
  fs::create_directories(dir + "/corpus");
  write_jsonl(dir + "/corpus/a.jsonl", {"from jsonl"});
  write_parquet(dir + "/corpus/b.parquet", table_of({"from parquet 1", "from parquet 2"}), 1);
  write_saved_dataset(dir + "/corpus/c_saved", {"from arrow 1", "from arrow 2", "from arrow 3"}, 2);
  const std::vector<std::string> expected = {"from jsonl",   "from parquet 1", "from parquet 2",
                                             "from arrow 1", "from arrow 2",   "from arrow 3"};
  EXPECT_EQ(texts_of(read_documents(config_for(dir + "/corpus"))), expected);
  EXPECT_EQ(texts_of(read_documents(config_for(dir + "/corpus/*.parquet"))),
            (std::vector<std::string>{"from parquet 1", "from parquet 2"}));
  fs::remove_all(dir);
}

TEST(DataArrow, MixtureSourcesReadParquetAndSaveToDiskFolders) {
  const std::string dir = test::temp_dir("kiln-data-arrow-mixture");
  const std::vector<std::string> docs = tricky_documents(30);
  write_parquet(dir + "/a.parquet", table_of(rows_of(docs)), 8);
  write_saved_dataset(dir + "/b", docs, 3);
  write_jsonl(dir + "/c.jsonl", docs);
  ByteTokenizer tokenizer;
  const auto mixture_of = [&](const std::string& first, const std::string& second) {
    DataConfig c;
    c.path = "";
    c.val_fraction = 0.2;
    c.sources = {DataSource{first, 1.0, "first"}, DataSource{second, 1.0, "second"}};
    return TokenDataset(c, tokenizer);
  };
  const TokenDataset arrow = mixture_of(dir + "/a.parquet", dir + "/b"), jsonl = mixture_of(dir + "/c.jsonl", dir + "/c.jsonl");
  for (const Split s : {Split::train, Split::validation}) {
    EXPECT_GT(jsonl.split(s).num_documents(), 0);
    EXPECT_EQ(test::documents_of(arrow.split(s)), test::documents_of(jsonl.split(s)));
  }
  fs::remove_all(dir);
}

// `kiln train-tokenizer` learns the same merges from Parquet and save_to_disk folders as
// from the JSONL of the same documents (the other columns never counted).
TEST(DataArrow, TrainTokenizerReadsParquetAndSaveToDiskAsJsonl) {
  const std::string dir = test::temp_dir("kiln-data-arrow-bpe");
  const std::vector<std::string> docs = tricky_documents(60);
  write_parquet(dir + "/corpus.parquet", table_of(rows_of(docs)), 16);
  write_saved_dataset(dir + "/saved", docs, 2);
  write_jsonl(dir + "/corpus.jsonl", docs);
  const auto tokenizer_from = [&](const std::string& input, const std::string& out) {
    std::string output;
    EXPECT_EQ(test::run_command(test::kiln_binary() + " train-tokenizer " + input + " --vocab-size 300 --threads 1 --out " +
                                    dir + "/" + out + " 2>&1",
                                &output),
              0)
        << output;
    return test::read_file(dir + "/" + out + "/tokenizer.json");
  };
  const std::string from_jsonl = tokenizer_from(dir + "/corpus.jsonl", "jsonl");
  EXPECT_NE(from_jsonl.find("\"merges\""), std::string::npos);
  EXPECT_EQ(tokenizer_from(dir + "/corpus.parquet", "parquet"), from_jsonl);
  EXPECT_EQ(tokenizer_from(dir + "/saved", "saved"), from_jsonl);
  fs::remove_all(dir);
}

// `kiln tokenize` writes the same shards from a save_to_disk folder and a Parquet file as
// from the JSONL of the same documents.
TEST(DataArrow, TokenizeWritesTheSameShardsAsFromJsonl) {
  const std::string dir = test::temp_dir("kiln-data-arrow-tokenize");
  const std::vector<std::string> docs = tricky_documents(50);
  write_parquet(dir + "/corpus.parquet", table_of(rows_of(docs)), 16);
  write_saved_dataset(dir + "/saved", docs, 2);
  write_jsonl(dir + "/corpus.jsonl", docs);
  const auto shard_of = [&](const std::string& input, const std::string& out) {
    std::string output;
    EXPECT_EQ(test::run_command(test::kiln_binary() + " tokenize " + input + " -o " + dir + "/" + out +
                                    " -q --threads 1 --set data.val_fraction=0.2 2>&1",
                                &output),
              0)
        << output;
    return test::read_file(dir + "/" + out + "/train_000000.kiln") + test::read_file(dir + "/" + out + "/val_000000.kiln");
  };
  const std::string from_jsonl = shard_of(dir + "/corpus.jsonl", "jsonl");
  EXPECT_GT(from_jsonl.size(), 1000u);
  EXPECT_EQ(shard_of(dir + "/corpus.parquet", "parquet"), from_jsonl);
  EXPECT_EQ(shard_of(dir + "/saved", "saved"), from_jsonl);
  fs::remove_all(dir);
}

// A large_string text column (datasets' Value("large_string")), and the IPC file format
// (Feather v2, "ARROW1" magic) beside the stream format save_to_disk writes.
TEST(DataArrow, LargeStringColumnsAndIpcFilesReadToo) {
  const std::string dir = test::temp_dir("kiln-data-arrow-large");
  const std::vector<std::string> docs = tricky_documents(12);
  arrow::LargeStringBuilder builder;
  for (const std::string& d : docs) ASSERT_TRUE(builder.Append(d).ok());
  const auto table = arrow::Table::Make(arrow::schema({arrow::field("text", arrow::large_utf8())}), {*builder.Finish()});
  write_parquet(dir + "/large.parquet", table, 5);
  EXPECT_EQ(texts_of(read_documents(config_for(dir + "/large.parquet"))), docs);
  auto out = arrow::io::FileOutputStream::Open(dir + "/large.arrow");
  ASSERT_TRUE(out.ok());
  auto writer = arrow::ipc::MakeFileWriter(*out, table->schema());
  ASSERT_TRUE(writer.ok());
  ASSERT_TRUE((*writer)->WriteTable(*table, 5).ok());
  ASSERT_TRUE((*writer)->Close().ok());
  ASSERT_TRUE((*out)->Close().ok());
  ASSERT_EQ(test::read_file(dir + "/large.arrow").substr(0, 6), "ARROW1");
  EXPECT_EQ(texts_of(read_documents(config_for(dir + "/large.arrow"))), docs);
  fs::remove_all(dir);
}

TEST(DataArrow, AMissingOrNonStringTextColumnIsAOneLineErrorListingTheColumns) {
  const std::string dir = test::temp_dir("kiln-data-arrow-columns");
  const std::string path = dir + "/corpus.parquet";
  write_parquet(path, table_of({"a", "b"}, "content"), 10);
  EXPECT_EQ(error_of([&] { read_documents(config_for(path)); }),
            "[data] " + path + ": no column 'text' (columns: id: int64, content: string); set data.text_key");
  DataConfig by_content = config_for(path);
  by_content.text_key = "content";
  EXPECT_EQ(texts_of(read_documents(by_content)), (std::vector<std::string>{"a", "b"}));
  DataConfig by_id = config_for(path);
  by_id.text_key = "id";
  EXPECT_EQ(error_of([&] { read_documents(by_id); }),
            "[data] " + path + ": column 'id' is int64, not string (columns: id: int64, content: string); set data.text_key");
  // The same check for an Arrow stream (a save_to_disk shard).
  write_arrow_stream(dir + "/shard.arrow", table_of({"a"}, "content"), 10);
  EXPECT_EQ(error_of([&] { read_documents(config_for(dir + "/shard.arrow", true)); }),
            "[data] " + dir + "/shard.arrow: no column 'text' (columns: id: int64, content: string); set data.text_key");
  fs::remove_all(dir);
}

TEST(DataArrow, ANullRowIsAnErrorNamingItOrSkippedWhenLenient) {
  const std::string dir = test::temp_dir("kiln-data-arrow-null");
  const Rows rows = {"zero", "one", std::nullopt, "three", "", "five"};
  write_parquet(dir + "/corpus.parquet", table_of(rows), 2);
  write_arrow_stream(dir + "/corpus.arrow", table_of(rows), 4);
  for (const std::string& path : {dir + "/corpus.parquet", dir + "/corpus.arrow"}) {
    EXPECT_EQ(error_of([&] { read_documents(config_for(path)); }), "[data] " + path + ":row 2: null in column 'text'");
    BadInputLog log(true);
    EXPECT_EQ(texts_of(read_documents(config_for(path, true), log)),
              (std::vector<std::string>{"zero", "one", "three", "five"}));
    EXPECT_EQ(log.counts()[BadInput::missing_text_key], 1);
    EXPECT_EQ(log.first(BadInput::missing_text_key), path + ":row 2");
    EXPECT_EQ(log.counts()[BadInput::empty_document], 1);
    EXPECT_EQ(log.first(BadInput::empty_document), path + ":row 4");
  }
  fs::remove_all(dir);
}

TEST(DataArrow, ADatasetDictFolderIsRefusedNamingItsSplits) {
  const std::string dir = test::temp_dir("kiln-data-arrow-dict");
  write_saved_dataset(dir + "/train", {"a train document"}, 1);
  write_saved_dataset(dir + "/test", {"a test document"}, 1);
  test::write_file(dir + "/dataset_dict.json", R"({"splits": ["train", "test"]})");
  EXPECT_EQ(error_of([&] { read_documents(config_for(dir)); }),
            "[data] '" + dir + "' is a Hugging Face DatasetDict (splits: train, test); set data.path to one split's "
            "folder, e.g. '" + dir + "/train'");
  EXPECT_EQ(texts_of(read_documents(config_for(dir + "/train"))), (std::vector<std::string>{"a train document"}));
  fs::remove_all(dir);
}

TEST(DataArrow, NotAParquetFileIsAOneLineErrorNamingIt) {
  const std::string dir = test::temp_dir("kiln-data-arrow-garbage");
  test::write_file(dir + "/corpus.parquet", "this is text, not Parquet\n");
  const std::string error = error_of([&] { read_documents(config_for(dir + "/corpus.parquet")); });
  EXPECT_EQ(error.rfind("[data] " + dir + "/corpus.parquet: not a readable Parquet file: ", 0), 0u) << error;
  EXPECT_EQ(error.find('\n'), std::string::npos) << error;
  fs::remove_all(dir);
}

// What `kiln train` says of its data ("2829 train / 174 validation documents (93.8k / 5.6k
// tokens) | ..."), the path left out.
std::string data_line(const std::string& output, const std::string& path) {
  const std::string prefix = "data " + path + ": ";
  const size_t at = output.find("\n" + prefix);
  if (at == std::string::npos) return "no data line in:\n" + output;
  const size_t begin = at + 1 + prefix.size();
  return output.substr(begin, output.find('\n', begin) - begin);
}

// `kiln train` with data.path a Parquet file of the bundled text's documents: a few steps
// on the CPU, with the same documents and tokens as from the equivalent JSONL.
TEST(DataArrow, TrainRunsOnAParquetFileAsOnTheSameJsonl) {
  const std::string dir = test::temp_dir("kiln-train-parquet");
  const std::vector<std::string> docs = texts_of(read_documents(config_for(KILN_SOURCE_DIR "/data/tinyshakespeare.txt")));
  write_parquet(dir + "/shakespeare.parquet", table_of(rows_of(docs)), 1000);
  write_jsonl(dir + "/shakespeare.jsonl", docs);
  const auto train = [&](const std::string& data, const std::string& run, std::string* output) {
    return test::run_command(test::kiln_binary() + " train " KILN_SOURCE_DIR "/configs/default.toml --set data.path=" +
                                 data + " --set train.out_dir=" + run +
                                 " --set model.hidden=32 --set model.layers=1 --set model.heads=2 --set model.kv_heads=1"
                                 " --set model.head_dim=16 --set model.ffn_hidden=64 --set model.max_seq_len=64"
                                 " --set train.micro_batch_tokens=256 --set train.steps=3 --set train.device=cpu"
                                 " --set train.eval_every=0 --set train.sample_every=0 --set train.sample_tokens=0"
                                 " --set train.threads=2 --set log.every=1 --set log.plot=false 2>&1",
                             output);
  };
  std::string parquet_output, jsonl_output;
  ASSERT_EQ(train(dir + "/shakespeare.parquet", dir + "/run", &parquet_output), 0) << parquet_output;
  EXPECT_EQ(test::train_records(dir + "/run").size(), 3u) << parquet_output;
  ASSERT_EQ(train(dir + "/shakespeare.jsonl", dir + "/run-jsonl", &jsonl_output), 0) << jsonl_output;
  const std::string line = data_line(parquet_output, dir + "/shakespeare.parquet");
  EXPECT_NE(line.find(" train / "), std::string::npos) << line;
  EXPECT_EQ(line, data_line(jsonl_output, dir + "/shakespeare.jsonl"));
  fs::remove_all(dir);
}

}  // namespace
}  // namespace kiln

// Byte-level BPE without the Python oracle: byte mapping, pre-tokenization, merge order,
// the trainer's determinism and round trips, invalid UTF-8, data.tokenizer resolution,
// and one-line errors for unsupported files.
#include "bpe_test_texts.h"
#include "core/error.h"
#include "data/bpe/bpe_model.h"
#include "data/bpe/bpe_tokenizer.h"
#include "data/bpe/bpe_trainer.h"
#include "data/bpe/byte_unicode.h"
#include "data/bpe/pretokenizer.h"
#include "data/tokenizer.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <omp.h>

namespace kiln {
namespace {

using nlohmann::json;

using test::error_of;

std::vector<std::string> pieces(const bpe::PreTokenizer& p, std::string_view text) {
  std::vector<std::string> out;
  p.run(text, [&](std::string_view piece) { out.emplace_back(piece); });
  return out;
}

TEST(BpeBytes, MappingIsGpt2sAndRoundTrips) {
  EXPECT_EQ(bpe::bytes_to_token(" "), "Ġ");
  EXPECT_EQ(bpe::bytes_to_token("\n"), "Ċ");
  EXPECT_EQ(bpe::bytes_to_token("a!~"), "a!~");
  EXPECT_EQ(bpe::byte_to_codepoint(0), 0x100u);
  EXPECT_EQ(bpe::byte_to_codepoint(0xAD), 0x143u);  // the last of the remapped bytes
  std::string all;
  for (int b = 0; b < 256; ++b) all.push_back(static_cast<char>(b));
  std::string back;
  ASSERT_TRUE(bpe::token_to_bytes(bpe::bytes_to_token(all), back));
  EXPECT_EQ(back, all);
  EXPECT_FALSE(bpe::token_to_bytes("a b", back));  // a literal space is not a mapped byte
}

TEST(BpePreTokenizer, Qwen2PatternSplitsLikeTokenizers) {
  bpe::PreTokenizer p;
  p.add_split(std::make_shared<bpe::Regex>(bpe::named_pattern("qwen2"), false, ""), bpe::SplitBehavior::isolated);
  p.add_byte_level(false, false);
  EXPECT_EQ(pieces(p, "Hello world's 123 !!\n\n  x"),
            (std::vector<std::string>{"Hello", " world", "'s", " ", "1", "2", "3", " !!\n\n", " ", " x"}));
  // NEL is whitespace for Oniguruma's \s, so a run of two splits like spaces do.
  EXPECT_EQ(pieces(p, "I'LL  go\u0085\u0085x"),
            (std::vector<std::string>{"I", "'LL", " ", " go", "\u0085", "\u0085x"}));
}

TEST(BpePreTokenizer, ByteLevelPrefixSpaceAndGpt2Regex) {
  bpe::PreTokenizer p;
  p.add_byte_level(true, true);
  EXPECT_EQ(pieces(p, "Hello  there"), (std::vector<std::string>{" Hello", " ", " there"}));
  EXPECT_EQ(pieces(p, " x"), (std::vector<std::string>{" x"}));
}

TEST(BpeModel, LowestRankMergesFirstAndLongWordsAgreeWithShortOnes) {
  // Tokens: bytes a=0 b=1 c=2, then ab=3 bc=4 abc=5 aa=6.
  bpe::StringMap vocab;
  const char* tokens[] = {"a", "b", "c", "ab", "bc", "abc", "aa"};
  for (int i = 0; i < 7; ++i) vocab.find_or_insert(tokens[i], i);
  const bpe::BpeModel model(std::move(vocab), {{1, 2, 4}, {0, 1, 3}, {3, 2, 5}, {0, 0, 6}}, {});
  auto encode = [&](std::string_view w) {
    std::vector<int32_t> ids;
    model.encode_word_uncached(w, ids);
    return ids;
  };
  EXPECT_EQ(encode("abc"), (std::vector<int32_t>{0, 4}));  // (b,c) ranks before (a,b)
  EXPECT_EQ(encode("ab"), (std::vector<int32_t>{3}));
  EXPECT_EQ(encode("aaa"), (std::vector<int32_t>{6, 0}));  // leftmost first
  // Past 64 bytes the heap path runs: 70 a's become 35 "aa", left to right.
  std::string run_word = std::string(70, 'a');
  EXPECT_EQ(encode(run_word), std::vector<int32_t>(35, 6));
  std::vector<int32_t> cached;
  model.encode_word(run_word, cached);
  model.encode_word(run_word, cached);
  EXPECT_EQ(cached.size(), 70u);
}

bpe::TrainedBpe train(const std::string& text, int threads, int64_t vocab = 600) {
  bpe::BpeTrainerOptions options;
  options.vocab_size = vocab;
  options.special_tokens = {"<|endoftext|>", "<|pad|>"};
  const int saved = omp_get_max_threads();
  omp_set_num_threads(threads);
  bpe::BpeTrainer trainer(options);
  trainer.add_text(text);
  omp_set_num_threads(saved);
  return trainer.train();
}

TEST(BpeTrainer, DeterministicAcrossThreadCountsAndRoundTrips) {
  // Over 1 MiB, so counting runs in several chunks.
  std::string text = test::read_file(KILN_SOURCE_DIR "/data/tinyshakespeare.txt");
  text += test::unicode_stress_text();
  const auto one = train(text, 1);
  const auto two = train(text, 2);
  EXPECT_EQ(one.merges, two.merges);
  EXPECT_EQ(one.tokens, two.tokens);
  ASSERT_EQ(one.tokens.size(), 600u);
  EXPECT_EQ(one.tokens[0], "<|endoftext|>");
  EXPECT_EQ(one.tokens[2 + 'e'], "e");
  EXPECT_EQ(one.tokens[258].size(), 2u);  // the first merge joins two bytes

  const std::string dir = test::temp_dir("kiln-bpe-train");
  bpe::write_tokenizer_files(one, dir, "<|endoftext|>", "<|endoftext|>", "<|pad|>", 1024);
  const auto tokenizer = tokenizer_from_config(dir + "/tokenizer.json");
  EXPECT_EQ(tokenizer->name(), "bpe");
  EXPECT_EQ(tokenizer->vocab_size(), 600);
  EXPECT_EQ(tokenizer->pad_id(), 1);
  for (const std::string& s : {test::unicode_stress_text(), test::random_stress_text(3, 5000), std::string()}) {
    const auto ids = tokenizer->encode(s);
    EXPECT_EQ(tokenizer->decode(ids), test::without_specials(s, *tokenizer));
  }
  const auto ids = tokenizer->encode(text.substr(0, 100000));
  EXPECT_LT(ids.size(), 100000u / 2);  // merges compress English at least 2x
}

TEST(BpeTrainer, FilesReadInBlocksCountLikeOneText) {
  const std::string path = KILN_SOURCE_DIR "/data/tinyshakespeare.txt";
  bpe::BpeTrainerOptions options;
  options.vocab_size = 400;
  bpe::BpeTrainer whole(options), blocks(options);
  whole.add_text(test::read_file(path));
  EXPECT_EQ(blocks.add_file(path, 10000), test::read_file(path).size());
  EXPECT_EQ(blocks.total_words(), whole.total_words());
  EXPECT_EQ(blocks.unique_words(), whole.unique_words());
  EXPECT_EQ(blocks.train().merges, whole.train().merges);
}

TEST(BpeTokenizer, InvalidUtf8RoundTripsByteForByte) {
  const std::string dir = test::temp_dir("kiln-bpe-utf8");
  bpe::write_tokenizer_files(train(test::unicode_stress_text() + "hello hello", 1, 300), dir, "<|endoftext|>",
                             "<|endoftext|>", "<|endoftext|>", 64);
  const auto tokenizer = make_tokenizer("hf", dir);
  const std::string bad = std::string("ok \xff\xfe bad \xc3 cut \xe6\x97 tail\x80 ") + "\xf0\x9f\x99\x82";
  EXPECT_EQ(tokenizer->decode(tokenizer->encode(bad)), bad);
  EXPECT_EQ(tokenizer->encode("<|endoftext|>"), std::vector<int32_t>{0});
  EXPECT_EQ(tokenizer->decode(std::vector<int32_t>{0, 1, 0}), tokenizer->decode(std::vector<int32_t>{1}));
  EXPECT_NE(error_of([&] { tokenizer->decode(std::vector<int32_t>{300}); }).find("outside the vocabulary"),
            std::string::npos);
}

TEST(BpeTokenizer, DataTokenizerSettingPicksByteOrAFile) {
  EXPECT_EQ(tokenizer_from_config("byte")->name(), "byte");
  const std::string missing = error_of([] { tokenizer_from_config("/nonexistent/tokenizer.json"); });
  EXPECT_NE(missing.find("[tokenizer] /nonexistent/tokenizer.json: no such file"), std::string::npos) << missing;
  const auto names = tokenizer_names();
  EXPECT_NE(std::find(names.begin(), names.end(), "bpe"), names.end());
}

// A minimal valid byte-level tokenizer.json with one part replaced.
std::string write_variant(const std::string& dir, const std::string& key, const json& value) {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[bpe::bytes_to_token(std::string(1, static_cast<char>(b)))] = b;
  vocab["<|endoftext|>"] = 256;
  json j = {{"added_tokens", json::array({{{"id", 256}, {"content", "<|endoftext|>"}, {"special", true}}})},
            {"normalizer", nullptr},
            {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
            {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", json::array()}}}};
  if (key == "model.merges") j["model"]["merges"] = value;
  else if (key == "model.type") j["model"]["type"] = value;
  else j[key] = value;
  const std::string path = dir + "/" + std::to_string(std::hash<std::string>()(key + value.dump())) + ".json";
  test::write_file(path, j.dump());
  return path;
}

TEST(BpeTokenizer, UnsupportedFilesAreOneLineErrorsNamingTheFileAndPart) {
  const std::string dir = test::temp_dir("kiln-bpe-errors");
  const std::string ok = write_variant(dir, "none", nullptr);
  EXPECT_EQ(make_tokenizer("bpe", ok)->encode("hi"), (std::vector<int32_t>{'h', 'i'}));
  const std::pair<std::string, json> cases[] = {
      {"normalizer", {{"type", "Lowercase"}}},
      {"pre_tokenizer", {{"type", "Metaspace"}}},
      {"pre_tokenizer", nullptr},
      {"model.type", "WordPiece"},
      {"model.merges", json::array({"a"})},
      {"model.merges", json::array({"a zz"})},
      {"pre_tokenizer", {{"type", "Split"}, {"pattern", {{"Regex", "(unclosed"}}}, {"behavior", "Isolated"}}},
      {"pre_tokenizer", {{"type", "Split"}, {"pattern", {{"Regex", "x"}}}, {"behavior", "Contiguous"}}},
  };
  const char* expected[] = {"unsupported normalizer 'Lowercase'", "unsupported pre_tokenizer 'Metaspace'",
                            "not a byte-level BPE", "unsupported model 'WordPiece'", "model.merges[0] 'a' is not two",
                            "model.merges[0] ('a', 'zz') uses a token missing", "bad regex '(unclosed'",
                            "unsupported Split behavior 'Contiguous'"};
  for (size_t i = 0; i < std::size(cases); ++i) {
    const std::string path = write_variant(dir, cases[i].first, cases[i].second);
    const std::string message = error_of([&] { make_tokenizer("bpe", path); });
    EXPECT_EQ(message.rfind("[tokenizer] " + path + ": ", 0), 0u) << message;
    EXPECT_NE(message.find(expected[i]), std::string::npos) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  }
  test::write_file(dir + "/broken.json", "{ not json");
  EXPECT_NE(error_of([&] { make_tokenizer("bpe", dir + "/broken.json"); }).find("not valid JSON"), std::string::npos);
}

TEST(BpeCli, TrainTokenizerRejectsBadArgumentsInOneLine) {
  std::string out;
  const std::string corpus = KILN_SOURCE_DIR "/data/tinyshakespeare.txt";
  EXPECT_NE(test::run_command(test::kiln_binary() + " train-tokenizer " + corpus + " --vocab-size 100 --out /tmp/x", &out), 0);
  EXPECT_NE(out.find("kiln: error: [train-tokenizer] --vocab-size 100 is below"), std::string::npos) << out;
  EXPECT_NE(test::run_command(test::kiln_binary() + " train-tokenizer " + corpus +
                                  " --vocab-size 300 --pattern '(bad' --out /tmp/x", &out), 0);
  EXPECT_NE(out.find("bad regex '(bad'"), std::string::npos) << out;
  // Before: the trainer sized a table by it and died of std::bad_alloc ("internal error").
  EXPECT_EQ(test::run_command(test::kiln_binary() + " train-tokenizer " + corpus + " --vocab-size 1000000000000 --out /tmp/x", &out), 1);
  EXPECT_EQ(out, "kiln: error: [train-tokenizer] --vocab-size 1000000000000 is above kiln's limit of 2097152 ids for a "
                 "tokenizer.json\n");
  // Issue 38: both were taken (-1 written into tokenizer_config.json).
  EXPECT_EQ(test::run_command(test::kiln_binary() + " train-tokenizer " + corpus +
                                  " --vocab-size 300 --min-frequency -5 --out /tmp/x", &out), 1);
  EXPECT_EQ(out, "kiln: error: [train-tokenizer] --min-frequency -5 must be >= 1\n");
  EXPECT_EQ(test::run_command(test::kiln_binary() + " train-tokenizer " + corpus +
                                  " --vocab-size 300 --model-max-length -1 --out /tmp/x", &out), 1);
  EXPECT_EQ(out, "kiln: error: [train-tokenizer] --model-max-length -1 must be >= 1\n");
}

// Issue 44: JSONL was read as plain text (the vocabulary learned `{"`, `":` and `text`) and a
// directory was refused. Inputs now go as data.path does: JSONL by its documents' text, a
// directory by every file below it; pre-tokenized files are refused by name.
TEST(BpeCli, TrainTokenizerReadsJsonlDocumentsAndDirectoriesAsDataPathDoes) {
  const std::string dir = test::temp_dir("kiln-train-tok-inputs");
  std::string jsonl;
  for (int i = 0; i < 200; ++i)
    jsonl += nlohmann::json{{"body", "the quick brown fox " + std::to_string(i) + " jumps over the lazy dog"}}.dump() + "\n";
  test::write_file(dir + "/corpus/a.jsonl", jsonl);
  test::write_file(dir + "/corpus/b.txt", "plain text beside it, read whole\n");
  std::string out;
  ASSERT_EQ(test::run_command(test::kiln_binary() + " train-tokenizer " + dir + "/corpus --text-key body --vocab-size 300 --out " +
                                  dir + "/tok",
                              &out),
            0)
      << out;
  EXPECT_NE(out.find("train-tokenizer: 2 files"), std::string::npos) << out;
  const nlohmann::json vocab = nlohmann::json::parse(test::read_file(dir + "/tok/tokenizer.json"))["model"]["vocab"];
  for (const auto& [token, id] : vocab.items()) {  // the learned tokens (the 256 bytes hold '{' alone)
    std::string bytes;
    ASSERT_TRUE(bpe::token_to_bytes(token, bytes)) << token;
    if (bytes.size() < 2) continue;
    EXPECT_EQ(token.find("body"), std::string::npos) << token;
    EXPECT_EQ(token.find('{'), std::string::npos) << token;
    EXPECT_EQ(token.find('"'), std::string::npos) << token;
  }
  EXPECT_TRUE(vocab.contains(bpe::bytes_to_token(" quick")) || vocab.contains(bpe::bytes_to_token(" the")));
  // A JSONL line without the key names the file and line, as training does.
  EXPECT_EQ(test::run_command(test::kiln_binary() + " train-tokenizer " + dir + "/corpus/a.jsonl --vocab-size 300 --out " +
                                  dir + "/tok2",
                              &out),
            1);
  EXPECT_NE(out.find(dir + "/corpus/a.jsonl:1"), std::string::npos) << out;
  test::write_file(dir + "/tokens.bin", std::string(1024, '\0'));
  EXPECT_EQ(test::run_command(test::kiln_binary() + " train-tokenizer " + dir + "/tokens.bin --vocab-size 300 --out " +
                                  dir + "/tok3",
                              &out),
            1);
  EXPECT_NE(out.find("(pre-tokenized); it reads text, JSONL, Parquet or Arrow"), std::string::npos) << out;
}

}  // namespace
}  // namespace kiln

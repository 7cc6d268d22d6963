// tokenizer.json as hostile input: every id, count and field is read typed and
// range-checked, and the error names the file and the field. Each case here was a crash,
// a silent misreading or an "internal error" before (docs/reliability.md lists them).
// The model-folder cases run the real `kiln` binary, since every command that reads a
// model (sample, serve, export, import, train) reaches the loader.
#include "data/bpe/bpe_tokenizer.h"
#include "data/bpe/byte_unicode.h"
#include "export_fixture.h"
#include "io/hf_export.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <functional>

namespace kiln {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// A minimal byte-level BPE tokenizer.json: the 256 bytes and <|endoftext|> = 256.
json byte_bpe() {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[bpe::bytes_to_token(std::string(1, static_cast<char>(b)))] = b;
  return {{"added_tokens", json::array({{{"id", 256}, {"content", "<|endoftext|>"}, {"special", true}}})},
          {"normalizer", nullptr},
          {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
          {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", json::array()}}}};
}

json edited(const std::function<void(json&)>& edit) {
  json j = byte_bpe();
  edit(j);
  return j;
}

// The message load_tokenizer_json throws for `j` written as DIR/tokenizer.json.
std::string load_error(const std::string& dir, const json& j, const std::string& config = "") {
  fs::remove_all(dir);
  test::write_file(dir + "/tokenizer.json", j.dump());
  if (!config.empty()) test::write_file(dir + "/tokenizer_config.json", config);
  return test::error_of([&] { bpe::load_tokenizer_json(dir); });
}

void expect_field_error(const std::string& message, const std::string& file, const std::string& field_error) {
  EXPECT_EQ(message.rfind("[tokenizer] " + file + ": ", 0), 0u) << message;
  EXPECT_NE(message.find(field_error), std::string::npos) << message;
  EXPECT_EQ(message.find('\n'), std::string::npos) << message;
}

// Before: the id was stored as an int32, `id + 1` wrapped to INT32_MIN, the id tables kept
// the vocabulary's size and the write at index 2147483647 went far past their end.
TEST(TokenizerJsonFields, AddedIdAtInt32MaxIsRefusedBeforeItIndexesAnything) {
  const std::string dir = test::temp_dir("kiln-tok-int32max");
  const std::string message = load_error(dir, edited([](json& j) { j["added_tokens"][0]["id"] = 2147483647; }));
  expect_field_error(message, dir + "/tokenizer.json",
                     "added_tokens[0].id = 2147483647 is out of range (ids must be below 2097152, kiln's limit");
  // The tokenizer itself refuses such parts too, whoever builds them.
  bpe::BpeTokenizerParts parts;
  parts.origin = "parts";
  parts.model = std::make_unique<bpe::BpeModel>(bpe::StringMap(), std::vector<bpe::BpeModel::Merge>{},
                                                bpe::BpeModelOptions{});
  parts.added.push_back({2147483647, "<|x|>", true});
  parts.bos_id = parts.eos_id = parts.pad_id = 2147483647;
  EXPECT_NE(test::error_of([&] { bpe::BpeTokenizer tokenizer(std::move(parts)); }).find("has id 2147483647 outside"),
            std::string::npos);
  fs::remove_all(dir);
}

// Before: nlohmann's get<int32_t>() kept the low 32 bits, so 2^32 + 3 silently became 3.
TEST(TokenizerJsonFields, IdsAboveThe32BitRangeDoNotWrap) {
  const std::string dir = test::temp_dir("kiln-tok-wrap");
  expect_field_error(load_error(dir, edited([](json& j) { j["added_tokens"][0]["id"] = 4294967299ull; })),
                     dir + "/tokenizer.json", "added_tokens[0].id = 4294967299 is out of range");
  expect_field_error(load_error(dir, edited([](json& j) { j["model"]["vocab"]["a"] = 18446744073709551615ull; })),
                     dir + "/tokenizer.json", "model.vocab['a'] = 18446744073709551615 is out of range");
  expect_field_error(load_error(dir, edited([](json& j) { j["added_tokens"][0]["id"] = 256.7; })),
                     dir + "/tokenizer.json", "added_tokens[0].id must be an integer, got number 256.7");
  fs::remove_all(dir);
}

// Before: "internal error: [json.exception.type_error.302] ...", naming neither the file
// nor the field; or the value was silently taken as its default (a flag that is a string).
TEST(TokenizerJsonFields, WrongTypesNameTheFileAndTheField) {
  const std::string dir = test::temp_dir("kiln-tok-types");
  const std::pair<std::function<void(json&)>, std::string> cases[] = {
      {[](json& j) { j["added_tokens"][0]["id"] = "256"; }, "added_tokens[0].id must be an integer, got string \"256\""},
      {[](json& j) { j["added_tokens"][0]["content"] = 7; }, "added_tokens[0].content must be a string, got number 7"},
      {[](json& j) { j["added_tokens"][0]["special"] = "true"; }, "added_tokens[0].special must be true or false"},
      {[](json& j) { j["added_tokens"][0].erase("id"); }, "added_tokens[0] has no member 'id'"},
      {[](json& j) { j["added_tokens"] = json::object(); }, "added_tokens must be an array, got an object"},
      {[](json& j) { j["model"]["type"] = 3; }, "model.type must be a string, got number 3"},
      {[](json& j) { j["model"]["dropout"] = "0.1"; }, "model.dropout must be a number, got string \"0.1\""},
      {[](json& j) { j["model"]["unk_token"] = json::array(); }, "model.unk_token must be a string, got an array"},
      {[](json& j) { j["model"]["vocab"] = json::array(); }, "model.vocab must be an object, got an array"},
      {[](json& j) { j["model"]["merges"] = "a b"; }, "model.merges must be an array, got string \"a b\""},
      {[](json& j) { j["model"]["byte_fallback"] = 1; }, "model.byte_fallback must be true or false, got number 1"},
      {[](json& j) { j["pre_tokenizer"]["use_regex"] = "no"; }, "pre_tokenizer.use_regex must be true or false"},
      {[](json& j) { j["pre_tokenizer"] = {{"type", "Sequence"}, {"pretokenizers", {{{"type", 5}}}}}; },
       "pre_tokenizer.pretokenizers[0].type must be a string, got number 5"},
      {[](json& j) { j["normalizer"] = {{"type", "Sequence"}, {"normalizers", "NFC"}}; },
       "normalizer.normalizers must be an array, got string \"NFC\""},
      {[](json& j) {
         j["pre_tokenizer"] = {{"type", "Sequence"},
                               {"pretokenizers", {{{"type", "Split"}, {"pattern", {{"Regex", 1}}}, {"behavior", "Isolated"}},
                                                  {{"type", "ByteLevel"}}}}};
       },
       "pre_tokenizer.pretokenizers[0].pattern.Regex must be a string, got number 1"},
  };
  for (const auto& [edit, expected] : cases) expect_field_error(load_error(dir, edited(edit)), dir + "/tokenizer.json", expected);
  // tokenizer_config.json is read the same way (before: a number was silently no token).
  expect_field_error(load_error(dir, byte_bpe(), R"({"eos_token": 5})"), dir + "/tokenizer_config.json",
                     "eos_token must be a token's text or {\"content\": ...}");
  expect_field_error(load_error(dir, byte_bpe(), R"({"bos_token": {"content": null}})"), dir + "/tokenizer_config.json",
                     "bos_token.content must be a string, got null");
  fs::remove_all(dir);
}

// A Sequence nested many thousands deep: before, the recursive reader overflowed the
// stack (SIGSEGV); now the depth is bounded and named.
TEST(TokenizerJsonFields, DeeplyNestedSequencesAreRefusedWithoutRecursingAway) {
  const std::string dir = test::temp_dir("kiln-tok-deep");
  fs::create_directories(dir);
  std::string nested = R"({"type": "NFC"})";
  std::string text = byte_bpe().dump();
  std::string open, close;
  for (int i = 0; i < 200000; ++i) open += R"({"type":"Sequence","normalizers":[)", close += "]}";
  text.replace(text.find(R"("normalizer":null)"), 17, "\"normalizer\":" + open + nested + close);
  test::write_file(dir + "/tokenizer.json", text);
  std::string output;
  EXPECT_EQ(test::run_command(test::kiln_binary() + " tokenize " KILN_SOURCE_DIR "/data/tinyshakespeare.txt -o " + dir +
                                  "/shards --set data.tokenizer=" + dir + "/tokenizer.json",
                              &output),
            1)
      << output;
  EXPECT_EQ(output.rfind("kiln: error: [tokenizer] " + dir + "/tokenizer.json: normalizer.normalizers[0]", 0), 0u) << output;
  EXPECT_NE(output.find("nests Sequences more than 16 deep"), std::string::npos) << output;
  EXPECT_EQ(std::count(output.begin(), output.end(), '\n'), 1) << output;
  fs::remove_all(dir);
}

// A kiln model folder (vocab_size 259) whose tokenizer.json is `j`.
std::string model_with_tokenizer(const std::string& dir, const json& j) {
  test::save_random_model(test::tiny_config(true, true, false), dir);
  test::write_file(dir + "/tokenizer.json", j.dump());
  return dir;
}

std::string expect_exit_1(const std::string& command) {
  std::string output;
  EXPECT_EQ(test::run_command(command, &output), 1) << command << "\n" << output;
  EXPECT_EQ(output.rfind("kiln: error: [tokenizer] ", 0), 0u) << output;
  EXPECT_EQ(std::count(output.begin(), output.end(), '\n'), 1) << output;
  return output;
}

// Before: sample, serve and export of this folder died of SIGSEGV in the loader.
TEST(TokenizerJsonFields, EveryCommandReadingTheModelFolderRefusesTheFileInOneLine) {
  const std::string root = test::temp_dir("kiln-tok-model");
  const std::string model =
      model_with_tokenizer(root + "/model", edited([](json& j) { j["added_tokens"][0]["id"] = 2147483647; }));
  const std::string expected = "kiln: error: [tokenizer] " + model +
                               "/tokenizer.json: added_tokens[0].id = 2147483647 is out of range (ids must be below 259, "
                               "model.vocab_size in " + model + "/config.toml)\n";
  const std::string kiln = test::kiln_binary();
  EXPECT_EQ(expect_exit_1(kiln + " sample " + model + " -n 1"), expected);
  EXPECT_EQ(expect_exit_1("timeout 120 " + kiln + " serve " + model + " --port 0"), expected);
  EXPECT_EQ(expect_exit_1(kiln + " export hf " + model + " " + root + "/hf"), expected);
  EXPECT_EQ(expect_exit_1(kiln + " export gguf " + model + " " + root + "/m.gguf"), expected);
  EXPECT_FALSE(fs::exists(root + "/m.gguf"));
  // data.tokenizer of a training run: no model yet, so kiln's own bound applies.
  const std::string train = expect_exit_1(kiln + " train " + KILN_SOURCE_DIR "/configs/default.toml --set data.tokenizer=" +
                                          model + "/tokenizer.json --set train.out_dir=" + root + "/run");
  EXPECT_NE(train.find("added_tokens[0].id = 2147483647 is out of range (ids must be below 2097152"), std::string::npos)
      << train;
  fs::remove_all(root);
}

// Before: a tokenizer with ids beyond the model's embedding loaded, and the model was fed
// (or asked to decode) ids it has no row for.
TEST(TokenizerJsonFields, IdsBeyondTheModelsVocabularyAreRefused) {
  const std::string root = test::temp_dir("kiln-tok-vocab");
  const std::string model = model_with_tokenizer(root + "/model", edited([](json& j) {
    j["added_tokens"].push_back({{"id", 300}, {"content", "<|extra|>"}, {"special", false}});
  }));
  EXPECT_EQ(expect_exit_1(test::kiln_binary() + " sample " + model + " -n 1"),
            "kiln: error: [tokenizer] " + model +
                "/tokenizer.json: added_tokens[1].id = 300 is out of range (ids must be below 259, model.vocab_size in " +
                model + "/config.toml)\n");
  fs::remove_all(root);
}

// Before: `kiln import hf` copied any tokenizer.json it did not recognize, unread, and the
// imported folder then crashed every command that used it.
TEST(TokenizerJsonFields, ImportHfLoadsTheTokenizerBeforeWritingAnything) {
  const std::string root = test::temp_dir("kiln-tok-import");
  const std::string model = test::save_random_model(test::tiny_config(true, true, false), root + "/model");
  io::export_hf(model, root + "/hf", {});
  test::write_file(root + "/hf/tokenizer.json", edited([](json& j) { j["added_tokens"][0]["id"] = 2147483647; }).dump());
  EXPECT_EQ(expect_exit_1(test::kiln_binary() + " import hf " + root + "/hf " + root + "/out"),
            "kiln: error: [tokenizer] " + root +
                "/hf/tokenizer.json: added_tokens[0].id = 2147483647 is out of range (ids must be below 259, "
                "vocab_size in " + root + "/hf/config.json)\n");
  EXPECT_FALSE(fs::exists(root + "/out/model.safetensors"));
  EXPECT_FALSE(fs::exists(root + "/out/tokenizer.json"));
  // A byte-level BPE that fits is imported with it.
  test::write_file(root + "/hf/tokenizer.json", byte_bpe().dump());
  fs::remove(root + "/hf/tokenizer_config.json");  // the byte-level one names <|bos|>, which this file lacks
  std::string output;
  ASSERT_EQ(test::run_command(test::kiln_binary() + " import hf " + root + "/hf " + root + "/out", &output), 0) << output;
  EXPECT_TRUE(fs::exists(root + "/out/tokenizer.json"));
  EXPECT_NE(output.find("tokenizer.json (byte-level BPE, 257 ids) copied next to the model"), std::string::npos) << output;
  fs::remove_all(root);
}

}  // namespace
}  // namespace kiln

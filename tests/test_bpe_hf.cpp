// kiln's byte-level BPE against Hugging Face `tokenizers` (the oracle, via
// test::kiln_python()): the same ids and decoded text for tokenizers trained by kiln and
// by `tokenizers` in the GPT-2, Llama-3 and Qwen2 configurations, on the bundled corpus
// and on Unicode stress texts; the trained files load in `tokenizers`; a model trains
// with a BPE tokenizer through data.tokenizer.
#include "bpe_test_texts.h"
#include "data/bpe/bpe_tokenizer.h"
#include "data/tokenizer.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <map>

namespace kiln {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

const std::string kOracle = KILN_SOURCE_DIR "/tests/python/tokenizer_oracle.py";
const std::string kShakespeare = KILN_SOURCE_DIR "/data/tinyshakespeare.txt";

struct Oracle {
  std::string dir;
  std::vector<std::string> texts;
  std::vector<std::string> text_names;
  json results;  // tokenizer.json path -> {"ids": [...], "decoded": [...]}
  std::string error;
};

std::string quote(const std::string& s) { return "'" + s + "'"; }

Oracle build_oracle() {
  Oracle o;
  o.dir = test::temp_dir("kiln-bpe-hf");
  const std::string stress_path = o.dir + "/stress.txt";
  test::write_file(stress_path, test::unicode_stress_text() + "\n" + test::random_stress_text(7, 40000));
  std::string out;
  const std::string py = test::kiln_python() + " " + kOracle;
  if (test::run_command(py + " build " + o.dir + "/hf " + kShakespeare + " " + stress_path, &out) != 0) {
    o.error = "oracle build failed:\n" + out;
    return o;
  }
  const std::string kiln = test::kiln_binary() + " train-tokenizer " + kShakespeare + " " + stress_path;
  if (test::run_command(kiln + " --vocab-size 3000 --out " + o.dir + "/kiln --special-tokens '<|endoftext|>' "
                                "'<|im_start|>' '<|mask|>' --threads 2", &out) != 0 ||
      test::run_command(kiln + " --vocab-size 2000 --pattern llama3 --nfc --min-frequency 3 --out " + o.dir +
                            "/kiln-llama3 --threads 1", &out) != 0) {
    o.error = "kiln train-tokenizer failed:\n" + out;
    return o;
  }
  o.texts = {test::read_file(kShakespeare), test::unicode_stress_text(), test::random_stress_text(11, 30000)};
  o.text_names = {"tinyshakespeare", "unicode stress", "random stress"};
  // Short texts whose edges matter: empty, one byte, lone specials, whitespace only.
  for (const char* s : {"", " ", "\n", "a", "<|endoftext|>", "  <|mask|>  ", "'s", "\r\n\r\n", "🙂", "e\u0301"}) {
    o.texts.push_back(s);
    o.text_names.push_back("short " + json(s).dump());
  }
  test::write_file(o.dir + "/texts.json", json(o.texts).dump());
  std::string paths;
  for (const char* name : {"hf/gpt2", "hf/gpt2-prefix", "hf/llama3", "hf/qwen2", "kiln", "kiln-llama3"})
    paths += " " + o.dir + "/" + name + "/tokenizer.json";
  if (test::run_command(py + " encode " + o.dir + "/oracle.json " + o.dir + "/texts.json" + paths, &out) != 0) {
    o.error = "oracle encode failed:\n" + out;
    return o;
  }
  o.results = json::parse(test::read_file(o.dir + "/oracle.json"));
  return o;
}

const Oracle& oracle() {
  static const Oracle o = build_oracle();
  return o;
}

// Compares kiln's ids and decoded text with the oracle's for every text.
void expect_matches_oracle(const std::string& name, bool lossless) {
  const Oracle& o = oracle();
  ASSERT_TRUE(o.error.empty()) << o.error;
  const std::string path = o.dir + "/" + name + "/tokenizer.json";
  const auto tokenizer = make_tokenizer("bpe", path);
  const auto* bpe = dynamic_cast<const bpe::BpeTokenizer*>(tokenizer.get());
  ASSERT_NE(bpe, nullptr);
  const json& expected = o.results.at(path);
  std::vector<std::string_view> views(o.texts.begin(), o.texts.end());
  const auto batch = tokenizer->encode_batch(views);
  for (size_t t = 0; t < o.texts.size(); ++t) {
    SCOPED_TRACE(name + " on " + o.text_names[t]);
    const auto want = expected["ids"][t].get<std::vector<int32_t>>();
    const std::vector<int32_t> got = tokenizer->encode(o.texts[t]);
    EXPECT_EQ(batch[t], got) << "encode_batch differs from encode";
    if (got != want) {
      size_t i = 0;
      while (i < got.size() && i < want.size() && got[i] == want[i]) ++i;
      auto show = [&](const std::vector<int32_t>& ids) {
        std::string s;
        for (size_t k = i; k < std::min(ids.size(), i + 6); ++k)
          s += std::to_string(ids[k]) + json(bpe->token_bytes(ids[k])).dump(-1, ' ', false, json::error_handler_t::replace) + " ";
        return s;
      };
      ADD_FAILURE() << "ids differ at " << i << " of " << want.size() << " (kiln has " << got.size()
                    << "): kiln " << show(got) << "| tokenizers " << show(want);
      continue;
    }
    const std::string decoded = tokenizer->decode(got);
    EXPECT_EQ(decoded, expected["decoded"][t].get<std::string>());
    if (lossless) EXPECT_EQ(decoded, test::without_specials(o.texts[t], *tokenizer)) << "decode(encode(x)) != x";
  }
}

// One test for all six tokenizers: the oracle run (training and encoding in Python) is
// the slow part, and ctest runs each test in its own process.
TEST(BpeOracle, IdsAndDecodedTextMatchTokenizers) {
  ASSERT_TRUE(oracle().error.empty()) << oracle().error;
  expect_matches_oracle("kiln", true);         // kiln-trained, qwen2 pattern
  expect_matches_oracle("kiln-llama3", false);  // kiln-trained, llama3 pattern, NFC
  expect_matches_oracle("hf/gpt2", true);       // ByteLevel(use_regex) pre-tokenizer
  expect_matches_oracle("hf/gpt2-prefix", false);  // add_prefix_space, "a b" merges
  expect_matches_oracle("hf/llama3", true);     // Split + ByteLevel, ignore_merges
  expect_matches_oracle("hf/qwen2", false);     // NFC; added tokens: single_word, lstrip/rstrip, normalized
  if (!::testing::Test::HasFailure()) fs::remove_all(oracle().dir);  // kept for inspection on failure
}

// A kiln-trained tokenizer in a fresh folder (fast: well under a second).
std::string train_kiln_tokenizer(const std::string& dir) {
  std::string out;
  EXPECT_EQ(test::run_command(test::kiln_binary() + " train-tokenizer " + kShakespeare +
                                  " --vocab-size 3000 --special-tokens '<|endoftext|>' '<|im_start|>' --out " + dir,
                              &out), 0) << out;
  return dir;
}

TEST(BpeOracle, KilnFilesLoadInTokenizersWithAPreTrainedTokenizerFastConfig) {
  const std::string dir = train_kiln_tokenizer(test::temp_dir("kiln-bpe-config"));
  std::string out;
  EXPECT_EQ(test::run_command(test::kiln_python() + " " + kOracle + " check-config " + dir, &out), 0) << out;
  const auto kiln = make_tokenizer("bpe", dir);
  EXPECT_EQ(kiln->vocab_size(), 3000);
  EXPECT_EQ(kiln->eos_id(), 0);  // the first special token
  EXPECT_EQ(kiln->bos_id(), 0);
  EXPECT_EQ(kiln->pad_id(), 0);
}

TEST(BpeOracle, ModelTrainsWithABpeTokenizerFromDataTokenizer) {
  const std::string dir = train_kiln_tokenizer(test::temp_dir("kiln-bpe-model"));
  const std::string base = test::kiln_binary() + " train " KILN_SOURCE_DIR "/configs/default.toml --set data.path=" +
                           kShakespeare + " --set data.tokenizer=" + dir + "/tokenizer.json --set train.out_dir=" +
                           dir + "/run --set model.hidden=32 --set model.layers=1 --set model.heads=2"
                           " --set model.kv_heads=1 --set model.head_dim=16 --set model.ffn_hidden=64"
                           " --set model.max_seq_len=64 --set train.micro_batch_tokens=256 --set train.steps=2"
                           " --set train.eval_every=0 --set train.eval_batches=1 --set train.sample_every=0"
                           " --set train.sample_tokens=4 --set log.every=1 --set train.threads=2";
  std::string out;
  EXPECT_EQ(test::run_command(base + " --set model.vocab_size=3000", &out), 0) << out;
  EXPECT_NE(out.find("step     2/2"), std::string::npos) << out;
  // The saved model carries its tokenizer: it samples after the original is gone, from
  // another working directory.
  EXPECT_EQ(test::read_file(dir + "/run/model/tokenizer.json"), test::read_file(dir + "/tokenizer.json"));
  EXPECT_EQ(test::read_file(dir + "/run/model/tokenizer_config.json"), test::read_file(dir + "/tokenizer_config.json"));
  std::filesystem::rename(dir + "/tokenizer.json", dir + "/moved.json");
  EXPECT_EQ(test::run_command("cd / && " + test::kiln_binary() + " sample " + dir + "/run/model -p 'ROMEO:' -n 8 -t 0",
                              &out),
            0)
      << out;
  EXPECT_NE(out.find("ROMEO:"), std::string::npos) << out;
  std::filesystem::rename(dir + "/moved.json", dir + "/tokenizer.json");
  // A byte-level run replacing it in the same folder leaves no BPE file behind to override
  // its tokenizer.
  EXPECT_EQ(test::run_command(base + " --overwrite --set model.vocab_size=259 --set data.tokenizer=byte", &out), 0)
      << out;
  EXPECT_FALSE(std::filesystem::exists(dir + "/run/model/tokenizer.json"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/run/model/tokenizer_config.json"));
  EXPECT_NE(test::run_command(base + " --overwrite --set model.vocab_size=259", &out), 0);
  EXPECT_NE(out.find("model.vocab_size"), std::string::npos) << out;
  EXPECT_NE(out.find("3000"), std::string::npos) << out;
}

}  // namespace
}  // namespace kiln

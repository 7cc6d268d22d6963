// The Hugging Face export's BOS (io/tokenizer_bos.h): transformers must encode text as kiln
// trained on it, BOS first. The post-processor forms a tokenizer.json may already have, and
// an exported BPE model checked through the `tokenizers` package.
#include "export_fixture.h"
#include "io/hf_export.h"
#include "io/model_dir.h"
#include "io/tokenizer_bos.h"
#include "data/bpe/byte_unicode.h"
#include "test_util.h"

#include <gtest/gtest.h>

#include <filesystem>

namespace kiln {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

const json kByteLevel = {
    {"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", false}};

// A byte-level BPE with one added token, <|endoftext|> (id 256): no BOS of its own, so
// kiln's BOS is its EOS, as for GPT-2's tokenizer.
json byte_bpe(const json& post_processor) {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[bpe::bytes_to_token(std::string(1, static_cast<char>(b)))] = b;
  const json endoftext = {{"id", 256},         {"content", "<|endoftext|>"}, {"single_word", false}, {"lstrip", false},
                          {"rstrip", false},   {"normalized", false},         {"special", true}};
  return {{"version", "1.0"},
          {"truncation", nullptr},
          {"padding", nullptr},
          {"added_tokens", json::array({endoftext})},
          {"normalizer", nullptr},
          {"decoder", kByteLevel},
          {"pre_tokenizer",
           {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", true}}},
          {"post_processor", post_processor},
          {"model",
           {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr}, {"continuing_subword_prefix", nullptr},
            {"end_of_word_suffix", nullptr}, {"fuse_unk", false}, {"byte_fallback", false}, {"vocab", vocab},
            {"merges", json::array()}}}};
}

TEST(TokenizerBos, APostProcessorWithoutTheBosGetsOneAfterIt) {
  const json none = io::with_bos_post_processor(byte_bpe(nullptr), 256, "t.json");
  EXPECT_EQ(none["post_processor"]["type"], "TemplateProcessing");
  EXPECT_EQ(none["post_processor"]["single"][0]["SpecialToken"]["id"], "<|endoftext|>");
  EXPECT_TRUE(io::tokenizer_adds_bos(none, 256));

  const json byte_level = io::with_bos_post_processor(byte_bpe(kByteLevel), 256, "t.json");
  EXPECT_EQ(byte_level["post_processor"]["type"], "Sequence");
  EXPECT_EQ(byte_level["post_processor"]["processors"][0], kByteLevel);  // kept, and run first
  EXPECT_TRUE(io::tokenizer_adds_bos(byte_level, 256));
  EXPECT_FALSE(io::tokenizer_adds_bos(byte_bpe(kByteLevel), 256));
  // Applied twice: the same file (an export of an imported export).
  EXPECT_EQ(io::with_bos_post_processor(byte_level, 256, "t.json"), byte_level);
}

TEST(TokenizerBos, ATokenizerThatAddsItAlreadyIsLeftAlone) {
  const json llama_like = byte_bpe({{"type", "TemplateProcessing"},
                                    {"single", {{{"SpecialToken", {{"id", "<|endoftext|>"}, {"type_id", 0}}}},
                                                {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}}});
  EXPECT_EQ(io::with_bos_post_processor(llama_like, 256, "t.json"), llama_like);
  const json roberta = byte_bpe({{"type", "RobertaProcessing"}, {"cls", {"<|endoftext|>", 256}}, {"sep", {"x", 1}}});
  EXPECT_EQ(io::with_bos_post_processor(roberta, 256, "t.json"), roberta);
  const json in_sequence = byte_bpe({{"type", "Sequence"}, {"processors", {kByteLevel, llama_like["post_processor"]}}});
  EXPECT_TRUE(io::tokenizer_adds_bos(in_sequence, 256));
  // Another token first is not kiln's BOS: it is added after.
  const json other_first = byte_bpe({{"type", "RobertaProcessing"}, {"cls", {"a", 65}}, {"sep", {"x", 1}}});
  EXPECT_FALSE(io::tokenizer_adds_bos(other_first, 256));
  EXPECT_THROW(io::with_bos_post_processor(byte_bpe(nullptr), 9999, "t.json"), Error);
}

TEST(TokenizerBos, TheExportEncodesAsKilnTrainedThroughTokenizers) {
  const std::string root = test::temp_dir("kiln-tok-bos");
  const std::string model = test::save_random_model(test::tiny_config(true, true, false), root + "/model");
  test::write_file(model + "/tokenizer.json", byte_bpe(kByteLevel).dump());
  io::export_hf(model, root + "/hf", {});
  const std::string text = "Hello, world";
  const auto tokenizer = io::model_tokenizer(model);
  std::string expected = std::to_string(tokenizer->bos_id());
  for (const int32_t id : tokenizer->encode(text)) expected += "," + std::to_string(id);
  std::string output;
  EXPECT_EQ(test::run_python("check_tokenizer_bos.py " + root + "/hf/tokenizer.json '" + text + "' " + expected, &output),
            0)
      << output;
  EXPECT_EQ(expected.rfind("256,", 0), 0u);
  fs::remove_all(root);
}

}  // namespace
}  // namespace kiln

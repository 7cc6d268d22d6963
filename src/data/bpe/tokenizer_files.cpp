// Writing a trained byte-level BPE as Hugging Face files: tokenizer.json (loads with
// tokenizers.Tokenizer.from_file and in kiln) and tokenizer_config.json
// (PreTrainedTokenizerFast, so AutoTokenizer needs no trust_remote_code).
#include "core/error.h"
#include "data/bpe/bpe_trainer.h"
#include "data/bpe/byte_unicode.h"

#include <nlohmann/json.hpp>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

namespace kiln::bpe {
namespace {

namespace fs = std::filesystem;
using nlohmann::ordered_json;

ordered_json byte_level(bool use_regex) {
  return {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", use_regex}};
}

ordered_json added_token(const std::string& content) {
  return {{"content", content}, {"single_word", false}, {"lstrip", false}, {"rstrip", false}, {"normalized", false},
          {"special", true}};
}

void write_json(const fs::path& path, const ordered_json& j) {
  std::string text;
  try {
    text = j.dump(2, ' ', false);
  } catch (const nlohmann::json::exception& e) {
    fail("train-tokenizer", "{}: {} (special tokens must be valid UTF-8)", path.string(), e.what());
  }
  std::ofstream out(path, std::ios::binary);
  out << text << '\n';
  out.close();  // flushes: a full disk shows here, not in a destructor that cannot report it
  KILN_CHECK(!out.fail(), "train-tokenizer", "{}: cannot write: {}", path.string(), std::strerror(errno));
}

}  // namespace

void write_tokenizer_files(const TrainedBpe& bpe, const std::string& dir, const std::string& bos,
                           const std::string& eos, const std::string& pad, int64_t model_max_length) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  KILN_CHECK(!ec, "train-tokenizer", "cannot create '{}': {}", dir, ec.message());

  // Token strings as tokenizer.json spells them: special tokens as they are, the rest
  // through the byte -> Unicode mapping.
  std::vector<std::string> spelled(bpe.tokens.size());
  for (size_t id = 0; id < bpe.tokens.size(); ++id)
    spelled[id] = id < bpe.num_special ? bpe.tokens[id] : bytes_to_token(bpe.tokens[id]);

  ordered_json added = ordered_json::array();
  for (size_t id = 0; id < bpe.num_special; ++id) {
    ordered_json t = {{"id", id}};
    t.update(added_token(bpe.tokens[id]));
    added.push_back(std::move(t));
  }
  ordered_json vocab = ordered_json::object();
  for (size_t id = 0; id < spelled.size(); ++id) vocab[spelled[id]] = id;
  ordered_json merges = ordered_json::array();
  for (const auto& [a, b] : bpe.merges) merges.push_back(spelled[static_cast<size_t>(a)] + " " + spelled[static_cast<size_t>(b)]);

  ordered_json j;
  j["version"] = "1.0";
  j["truncation"] = nullptr;
  j["padding"] = nullptr;
  j["added_tokens"] = std::move(added);
  j["normalizer"] = bpe.nfc ? ordered_json{{"type", "NFC"}} : ordered_json(nullptr);
  j["pre_tokenizer"] = {{"type", "Sequence"},
                        {"pretokenizers",
                         {{{"type", "Split"}, {"pattern", {{"Regex", bpe.pattern}}}, {"behavior", "Isolated"}, {"invert", false}},
                          byte_level(false)}}};
  j["post_processor"] = byte_level(false);
  j["decoder"] = byte_level(false);
  j["model"] = {{"type", "BPE"},          {"dropout", nullptr},        {"unk_token", nullptr},
                {"continuing_subword_prefix", nullptr}, {"end_of_word_suffix", nullptr}, {"fuse_unk", false},
                {"byte_fallback", false}, {"ignore_merges", false}, {"vocab", std::move(vocab)},
                {"merges", std::move(merges)}};
  write_json(fs::path(dir) / "tokenizer.json", j);

  ordered_json decoder = ordered_json::object();
  for (size_t id = 0; id < bpe.num_special; ++id) decoder[std::to_string(id)] = added_token(bpe.tokens[id]);
  ordered_json config;
  config["tokenizer_class"] = "PreTrainedTokenizerFast";
  config["bos_token"] = bos;
  config["eos_token"] = eos;
  config["pad_token"] = pad;
  config["unk_token"] = nullptr;
  config["model_max_length"] = model_max_length;
  config["clean_up_tokenization_spaces"] = false;
  config["added_tokens_decoder"] = std::move(decoder);
  write_json(fs::path(dir) / "tokenizer_config.json", config);
}

}  // namespace kiln::bpe

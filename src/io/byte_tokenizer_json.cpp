#include "io/byte_tokenizer_json.h"

#include "core/error.h"

#include <array>
#include <map>

namespace kiln::io {

using nlohmann::json;

namespace {

// GPT-2's bytes_to_unicode(): printable Latin-1 bytes map to themselves, the other 68
// bytes to U+0100 onwards, in byte order.
std::array<char32_t, 256> make_byte_map() {
  std::array<char32_t, 256> map{};
  std::array<bool, 256> printable{};
  for (int b = '!'; b <= '~'; ++b) printable[static_cast<size_t>(b)] = true;
  for (int b = 0xA1; b <= 0xAC; ++b) printable[static_cast<size_t>(b)] = true;
  for (int b = 0xAE; b <= 0xFF; ++b) printable[static_cast<size_t>(b)] = true;
  char32_t next = 256;
  for (int b = 0; b < 256; ++b) map[static_cast<size_t>(b)] = printable[static_cast<size_t>(b)] ? char32_t(b) : next++;
  return map;
}

std::string utf8(char32_t c) {
  std::string s;
  if (c < 0x80) {
    s.push_back(static_cast<char>(c));
  } else if (c < 0x800) {
    s.push_back(static_cast<char>(0xC0 | (c >> 6)));
    s.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else {
    s.push_back(static_cast<char>(0xE0 | (c >> 12)));
    s.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    s.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  }
  return s;
}

json byte_level(bool with_regex_flag) {
  json j = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}};
  if (with_regex_flag) j["use_regex"] = false;
  return j;
}

json added_token(int32_t id, const char* text) {
  return {{"id", id},          {"content", text},     {"single_word", false}, {"lstrip", false},
          {"rstrip", false},   {"normalized", false}, {"special", true}};
}

}  // namespace

std::string gpt2_byte_char(uint8_t b) {
  static const std::array<char32_t, 256> map = make_byte_map();
  return utf8(map[b]);
}

bool is_byte_tokenizer(const Tokenizer& t) {
  return t.name() == "byte" && t.vocab_size() == ByteTokenizer::kVocab && t.bos_id() == ByteTokenizer::kBos &&
         t.eos_id() == ByteTokenizer::kEos && t.pad_id() == ByteTokenizer::kPad;
}

json byte_tokenizer_json() {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[gpt2_byte_char(static_cast<uint8_t>(b))] = b;
  json bos_template = {{"SpecialToken", {{"id", kBosText}, {"type_id", 0}}}};
  json post = {
      {"type", "TemplateProcessing"},
      {"single", {bos_template, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
      {"pair",
       {bos_template, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}, bos_template,
        {{"Sequence", {{"id", "B"}, {"type_id", 1}}}}}},
      {"special_tokens",
       {{kBosText, {{"id", kBosText}, {"ids", {ByteTokenizer::kBos}}, {"tokens", {kBosText}}}}}},
  };
  json j;
  j["version"] = "1.0";
  j["truncation"] = nullptr;
  j["padding"] = nullptr;
  j["added_tokens"] = {added_token(ByteTokenizer::kBos, kBosText), added_token(ByteTokenizer::kEos, kEosText),
                       added_token(ByteTokenizer::kPad, kPadText)};
  j["normalizer"] = nullptr;
  j["pre_tokenizer"] = byte_level(true);
  j["post_processor"] = post;
  j["decoder"] = byte_level(true);
  j["model"] = {{"type", "BPE"},
                {"dropout", nullptr},
                {"unk_token", nullptr},
                {"continuing_subword_prefix", nullptr},
                {"end_of_word_suffix", nullptr},
                {"fuse_unk", false},
                {"byte_fallback", false},
                {"ignore_merges", false},
                {"vocab", vocab},
                {"merges", json::array()}};
  return j;
}

json byte_tokenizer_config_json(int64_t model_max_length) {
  json added = json::object();
  for (const auto& [id, text] : {std::pair{ByteTokenizer::kBos, kBosText}, std::pair{ByteTokenizer::kEos, kEosText},
                                 std::pair{ByteTokenizer::kPad, kPadText}})
    added[std::to_string(id)] = {{"content", text}, {"lstrip", false}, {"normalized", false},
                                 {"rstrip", false}, {"single_word", false}, {"special", true}};
  return {{"tokenizer_class", "PreTrainedTokenizerFast"},
          {"bos_token", kBosText},
          {"eos_token", kEosText},
          {"pad_token", kPadText},
          {"unk_token", nullptr},
          {"add_bos_token", true},
          {"add_eos_token", false},
          {"clean_up_tokenization_spaces", false},
          {"model_max_length", model_max_length},
          {"added_tokens_decoder", added}};
}

bool is_byte_tokenizer_json(const json& j) {
  try {
    const json ours = byte_tokenizer_json();
    const json& model = j.at("model");
    if (model.at("type") != "BPE" || model.at("vocab") != ours["model"]["vocab"] || !model.at("merges").empty())
      return false;
    if (j.at("pre_tokenizer").value("type", "") != "ByteLevel" || j.at("pre_tokenizer").value("use_regex", true))
      return false;
    if (!j.at("normalizer").is_null()) return false;
    std::map<int64_t, std::string> specials;
    for (const auto& t : j.at("added_tokens")) specials[t.at("id").get<int64_t>()] = t.at("content");
    return specials == std::map<int64_t, std::string>{
                           {ByteTokenizer::kBos, kBosText}, {ByteTokenizer::kEos, kEosText}, {ByteTokenizer::kPad, kPadText}};
  } catch (const json::exception&) {
    return false;
  }
}

GgufVocab byte_gguf_vocab(int64_t vocab_size) {
  KILN_CHECK(vocab_size >= ByteTokenizer::kVocab, "export", "model.vocab_size = {} is smaller than the byte vocabulary ({})",
             vocab_size, ByteTokenizer::kVocab);
  GgufVocab v;
  for (int b = 0; b < 256; ++b) {
    v.tokens.push_back(gpt2_byte_char(static_cast<uint8_t>(b)));
    v.types.push_back(1);
  }
  for (const char* s : {kBosText, kEosText, kPadText}) {
    v.tokens.push_back(s);
    v.types.push_back(3);
  }
  for (int64_t id = ByteTokenizer::kVocab; id < vocab_size; ++id) {
    v.tokens.push_back("<|unused_" + std::to_string(id) + "|>");
    v.types.push_back(5);
  }
  return v;
}

}  // namespace kiln::io

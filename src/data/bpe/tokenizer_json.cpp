// Reading a Hugging Face tokenizer.json into a BpeTokenizer.
#include "core/error.h"
#include "core/json_file.h"
#include "data/bpe/bpe_tokenizer.h"
#include "data/bpe/byte_unicode.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <filesystem>

namespace kiln::bpe {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// Errors name the file: "[tokenizer] FILE: message".
template <typename... Args>
[[noreturn]] void fail_file(const std::string& file, fmt::format_string<Args...> format, Args&&... args) {
  fail("tokenizer", "{}: {}", file, fmt::format(format, std::forward<Args>(args)...));
}

std::string type_of(const json& j) { return j.is_object() && j.contains("type") && j["type"].is_string() ? j["type"].get<std::string>() : "?"; }

bool flag(const json& j, const char* key, bool fallback) {
  const auto it = j.find(key);
  return it != j.end() && it->is_boolean() ? it->get<bool>() : fallback;
}

void parse_normalizer(const std::string& file, const json& j, Normalizer& out) {
  if (j.is_null()) return;
  const std::string type = type_of(j);
  if (type == "Sequence") {
    for (const json& n : j.value("normalizers", json::array())) parse_normalizer(file, n, out);
    return;
  }
  NormalForm form;
  if (!parse_normal_form(type, form)) fail_file(file, "unsupported normalizer '{}' (kiln supports NFC, NFD, NFKC, NFKD)", type);
  out.add(form);
}

void parse_pre_tokenizer(const std::string& file, const json& j, PreTokenizer& out) {
  if (j.is_null()) return;
  const std::string type = type_of(j);
  if (type == "Sequence") {
    for (const json& p : j.value("pretokenizers", json::array())) parse_pre_tokenizer(file, p, out);
    return;
  }
  if (type == "ByteLevel") {
    out.add_byte_level(flag(j, "add_prefix_space", true), flag(j, "use_regex", true));
    return;
  }
  if (type == "Split") {
    if (out.has_byte_level()) fail_file(file, "unsupported pre_tokenizer: a Split after ByteLevel");
    if (flag(j, "invert", false)) fail_file(file, "unsupported pre_tokenizer: Split with invert=true");
    const std::string behavior = j.value("behavior", std::string("?"));
    SplitBehavior b;
    if (behavior == "Isolated") b = SplitBehavior::isolated;
    else if (behavior == "Removed") b = SplitBehavior::removed;
    else fail_file(file, "unsupported Split behavior '{}' (kiln supports Isolated, Removed)", behavior);
    const json& pattern = j.value("pattern", json::object());
    if (pattern.contains("Regex")) out.add_split(std::make_shared<Regex>(pattern["Regex"].get<std::string>(), false, file), b);
    else if (pattern.contains("String")) out.add_split(std::make_shared<Regex>(pattern["String"].get<std::string>(), true, file), b);
    else fail_file(file, "Split pre_tokenizer without a Regex or String pattern");
    return;
  }
  fail_file(file, "unsupported pre_tokenizer '{}' (kiln supports ByteLevel, Split, Sequence)", type);
}

// "a b" (legacy) or ["a", "b"].
std::pair<std::string, std::string> parse_merge(const std::string& file, const json& m, size_t index) {
  if (m.is_string()) {
    const std::string& s = m.get_ref<const std::string&>();
    const size_t space = s.find(' ');
    if (space == std::string::npos || space == 0 || space + 1 == s.size())
      fail_file(file, "model.merges[{}] '{}' is not two tokens separated by a space", index, s);
    return {s.substr(0, space), s.substr(space + 1)};
  }
  if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) return {m[0].get<std::string>(), m[1].get<std::string>()};
  fail_file(file, "model.merges[{}] is neither \"a b\" nor [\"a\", \"b\"]", index);
}

// A token named in tokenizer_config.json: a string or {"content": ...}.
std::string config_token(const json& config, const char* key) {
  const auto it = config.find(key);
  if (it == config.end() || it->is_null()) return "";
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) return (*it)["content"].get<std::string>();
  return "";
}

}  // namespace

std::unique_ptr<BpeTokenizer> load_tokenizer_json(const std::string& path) {
  std::string file = path;
  if (fs::is_directory(file)) file = (fs::path(file) / "tokenizer.json").string();
  if (!fs::is_regular_file(file)) fail_file(file, "no such file (data.tokenizer is 'byte' or a tokenizer.json path)");
  const json j = read_json_file(file, "tokenizer");
  if (!j.is_object() || !j.contains("model")) fail_file(file, "not a tokenizer.json (no 'model')");

  BpeTokenizerParts parts;
  parts.origin = file;
  const json& model = j["model"];
  const std::string model_type = model.value("type", std::string("BPE"));
  if (model_type != "BPE") fail_file(file, "unsupported model '{}' (kiln supports BPE)", model_type);
  if (model.contains("dropout") && !model["dropout"].is_null() && model["dropout"].get<double>() > 0.0)
    fail_file(file, "unsupported model.dropout (BPE dropout is for training only)");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (model.contains(key) && model[key].is_string() && !model[key].get<std::string>().empty())
      fail_file(file, "unsupported model.{} '{}'", key, model[key].get<std::string>());
  if (!model.contains("vocab") || !model["vocab"].is_object()) fail_file(file, "model.vocab is missing");
  if (!model.contains("merges") || !model["merges"].is_array()) fail_file(file, "model.merges is missing");

  // The vocabulary as written (byte-level mapped strings) and as raw bytes.
  const json& vocab = model["vocab"];
  StringMap mapped(vocab.size()), bytes(vocab.size());
  for (const auto& [token, value] : vocab.items()) {
    if (!value.is_number_integer() || value.get<int64_t>() < 0 || value.get<int64_t>() > (1 << 30))
      fail_file(file, "model.vocab['{}'] is not a valid id", token);
    const auto id = value.get<int32_t>();
    mapped.find_or_insert(token, id);
    if (static_cast<size_t>(id) >= parts.id_to_bytes.size()) parts.id_to_bytes.resize(static_cast<size_t>(id) + 1);
    std::string raw;
    // A token outside the byte mapping can never come out of the model; it decodes as
    // its UTF-8 text, as the ByteLevel decoder does.
    if (token_to_bytes(token, raw)) bytes.find_or_insert(raw, id);
    else raw = token;
    parts.id_to_bytes[static_cast<size_t>(id)] = std::move(raw);
  }
  auto id_of = [&](const std::string& token) {
    const int64_t i = mapped.find(token);
    return i < 0 ? -1 : static_cast<int32_t>(mapped.value(static_cast<size_t>(i)));
  };
  std::vector<BpeModel::Merge> merges;
  const json& merge_list = model["merges"];
  merges.reserve(merge_list.size());
  for (size_t i = 0; i < merge_list.size(); ++i) {
    const auto [a, b] = parse_merge(file, merge_list[i], i);
    const int32_t left = id_of(a), right = id_of(b), merged = id_of(a + b);
    if (left < 0 || right < 0 || merged < 0)
      fail_file(file, "model.merges[{}] ('{}', '{}') uses a token missing from model.vocab", i, a, b);
    merges.push_back({left, right, merged});
  }
  BpeModelOptions options;
  options.ignore_merges = flag(model, "ignore_merges", false);
  options.fuse_unk = flag(model, "fuse_unk", false);
  options.byte_fallback = flag(model, "byte_fallback", false);
  if (model.contains("unk_token") && model["unk_token"].is_string()) options.unk_id = id_of(model["unk_token"].get<std::string>());
  parts.model = std::make_unique<BpeModel>(std::move(bytes), merges, options);

  for (const json& t : j.value("added_tokens", json::array())) {
    AddedToken a;
    a.id = t.value("id", -1);
    a.content = t.value("content", std::string());
    a.special = flag(t, "special", false);
    a.single_word = flag(t, "single_word", false);
    a.lstrip = flag(t, "lstrip", false);
    a.rstrip = flag(t, "rstrip", false);
    a.normalized = flag(t, "normalized", !a.special);
    if (a.id < 0 || a.content.empty()) fail_file(file, "added_tokens entry without an id or content");
    parts.added.push_back(std::move(a));
  }
  parse_normalizer(file, j.value("normalizer", json()), parts.normalizer);
  parse_pre_tokenizer(file, j.value("pre_tokenizer", json()), parts.pretokenizer);
  if (!parts.pretokenizer.has_byte_level())
    fail_file(file, "not a byte-level BPE: pre_tokenizer has no ByteLevel step (kiln supports byte-level BPE only)");

  // BOS/EOS/PAD: tokenizer_config.json beside the file, else well-known names.
  auto token_id = [&](const std::string& content) -> int32_t {
    if (content.empty()) return -1;
    for (const AddedToken& a : parts.added)
      if (a.content == content) return a.id;
    return id_of(content);
  };
  const fs::path config_path = fs::path(file).parent_path() / "tokenizer_config.json";
  std::string bos, eos, pad;
  if (fs::is_regular_file(config_path)) {
    const json config = read_json_file(config_path.string(), "tokenizer");
    bos = config_token(config, "bos_token"), eos = config_token(config, "eos_token"), pad = config_token(config, "pad_token");
    for (const auto& [key, name] : {std::pair{"bos_token", &bos}, {"eos_token", &eos}, {"pad_token", &pad}})
      if (!name->empty() && token_id(*name) < 0) fail_file(config_path.string(), "{} '{}' is not in the vocabulary", key, *name);
  }
  auto first_known = [&](std::initializer_list<const char*> names) {
    for (const char* n : names)
      if (token_id(n) >= 0) return std::string(n);
    return std::string();
  };
  if (eos.empty()) eos = first_known({"<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "<|im_end|>"});
  if (eos.empty())
    fail_file(file, "no end-of-text token: add a tokenizer_config.json with eos_token beside it");
  if (bos.empty()) bos = first_known({"<|begin_of_text|>", "<s>", "<bos>", "<|bos|>"});
  if (pad.empty()) pad = first_known({"<pad>", "<|pad|>", "<|finetune_right_pad_id|>"});
  parts.eos_id = token_id(eos);
  parts.bos_id = bos.empty() ? parts.eos_id : token_id(bos);
  parts.pad_id = pad.empty() ? parts.eos_id : token_id(pad);
  return std::make_unique<BpeTokenizer>(std::move(parts));
}

}  // namespace kiln::bpe

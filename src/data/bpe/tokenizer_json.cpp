// Reading a Hugging Face tokenizer.json into a BpeTokenizer. Every field goes through
// JsonField: a wrong type or an id out of range is a one-line error naming the file and
// the field, checked before the id indexes anything.
#include "core/error.h"
#include "core/printable.h"
#include "core/json_field.h"
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

// Sequence inside Sequence: real files nest one or two deep; a hostile file nested
// thousands deep would overflow the stack of this recursive reader.
constexpr int kMaxNesting = 16;

// A normalizer or pre_tokenizer step: an object with a string "type".
std::string type_of(const JsonField& step) { return step.member("type").string(); }

void check_nesting(const JsonField& step, int depth) {
  if (depth >= kMaxNesting) step.fail(fmt::format("nests Sequences more than {} deep", kMaxNesting));
}

void parse_normalizer(const std::string& file, const JsonField& j, Normalizer& out, int depth) {
  const std::string type = type_of(j);
  if (type == "Sequence") {
    check_nesting(j, depth);
    const JsonField steps = j.member("normalizers");
    for (size_t i = 0; i < steps.array_size(); ++i) parse_normalizer(file, steps.element(i), out, depth + 1);
    return;
  }
  NormalForm form;
  if (!parse_normal_form(type, form)) fail_file(file, "unsupported normalizer '{}' (kiln supports NFC, NFD, NFKC, NFKD)", printable(type));
  out.add(form);
}

void parse_pre_tokenizer(const std::string& file, const JsonField& j, PreTokenizer& out, int depth) {
  const std::string type = type_of(j);
  if (type == "Sequence") {
    check_nesting(j, depth);
    const JsonField steps = j.member("pretokenizers");
    for (size_t i = 0; i < steps.array_size(); ++i) parse_pre_tokenizer(file, steps.element(i), out, depth + 1);
    return;
  }
  if (type == "ByteLevel") {
    out.add_byte_level(j.boolean_or("add_prefix_space", true), j.boolean_or("use_regex", true));
    return;
  }
  if (type == "Split") {
    if (out.has_byte_level()) fail_file(file, "unsupported pre_tokenizer: a Split after ByteLevel");
    if (j.boolean_or("invert", false)) fail_file(file, "unsupported pre_tokenizer: Split with invert=true");
    const std::string behavior = j.string_or("behavior", "?");
    SplitBehavior b;
    if (behavior == "Isolated") b = SplitBehavior::isolated;
    else if (behavior == "Removed") b = SplitBehavior::removed;
    else fail_file(file, "unsupported Split behavior '{}' (kiln supports Isolated, Removed)", printable(behavior));
    const JsonField pattern = j.member("pattern");
    if (const auto regex = pattern.find("Regex")) out.add_split(std::make_shared<Regex>(regex->string(), false, file), b);
    else if (const auto text = pattern.find("String")) out.add_split(std::make_shared<Regex>(text->string(), true, file), b);
    else fail_file(file, "Split pre_tokenizer without a Regex or String pattern");
    return;
  }
  fail_file(file, "unsupported pre_tokenizer '{}' (kiln supports ByteLevel, Split, Sequence)", printable(type));
}

// "a b" (legacy) or ["a", "b"].
std::pair<std::string, std::string> parse_merge(const std::string& file, const JsonField& m, size_t index) {
  if (m.is_string()) {
    const std::string& s = m.string();
    const size_t space = s.find(' ');
    if (space == std::string::npos || space == 0 || space + 1 == s.size())
      fail_file(file, "model.merges[{}] '{}' is not two tokens separated by a space", index, printable(s));
    return {s.substr(0, space), s.substr(space + 1)};
  }
  if (m.is_array() && m.array_size() == 2 && m.element(0).is_string() && m.element(1).is_string())
    return {m.element(0).string(), m.element(1).string()};
  fail_file(file, "model.merges[{}] is neither \"a b\" nor [\"a\", \"b\"]", index);
}

// A token named in tokenizer_config.json: absent, null, a string or {"content": "..."}.
std::string config_token(const JsonField& config, const char* key) {
  const auto token = config.find(key);
  if (!token) return "";
  if (token->is_object()) return token->member("content").string();
  if (!token->is_string()) token->fail("must be a token's text or {\"content\": ...}");
  return token->string();
}

// A token id of the file, checked against the limit before it indexes anything.
int32_t read_id(const JsonField& field, const TokenIdLimit& limit) {
  return static_cast<int32_t>(
      field.integer(0, limit.end - 1, fmt::format("ids must be below {}, {}", limit.end, limit.source)));
}

}  // namespace

TokenIdLimit TokenIdLimit::of_model(int64_t vocab_size, std::string source) {
  if (vocab_size >= kMaxTokenizerIds) return {};
  return {vocab_size, std::move(source)};
}

std::unique_ptr<BpeTokenizer> load_tokenizer_json(const std::string& path, const TokenIdLimit& limit) {
  KILN_CHECK(limit.end > 0 && limit.end <= kMaxTokenizerIds, "tokenizer", "{}: token id limit {} is outside (0, {}]",
             path, limit.end, kMaxTokenizerIds);
  std::string file = path;
  if (fs::is_directory(file)) file = (fs::path(file) / "tokenizer.json").string();
  if (!fs::is_regular_file(file)) fail_file(file, "no such file (data.tokenizer is 'byte' or a tokenizer.json path)");
  const json doc = read_json_file(file, "tokenizer");
  if (!doc.is_object() || !doc.contains("model")) fail_file(file, "not a tokenizer.json (no 'model')");
  const JsonField root(doc, "tokenizer", file);

  BpeTokenizerParts parts;
  parts.origin = file;
  const JsonField model = root.member("model");
  const std::string model_type = model.string_or("type", "BPE");
  if (model_type != "BPE") fail_file(file, "unsupported model '{}' (kiln supports BPE)", printable(model_type));
  if (const auto dropout = model.find("dropout"); dropout && dropout->number() > 0.0)
    fail_file(file, "unsupported model.dropout (BPE dropout is for training only)");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (const std::string affix = model.string_or(key, ""); !affix.empty())
      fail_file(file, "unsupported model.{} '{}'", key, printable(affix));

  // The vocabulary as written (byte-level mapped strings) and as raw bytes.
  const JsonField vocab = model.member("vocab");
  const JsonField merge_list = model.member("merges");
  StringMap mapped(vocab.value().size()), bytes(vocab.value().size());
  vocab.for_each_member([&](const std::string& token, const JsonField& value) {
    const int32_t id = read_id(value, limit);
    mapped.find_or_insert(token, id);
    if (static_cast<size_t>(id) >= parts.id_to_bytes.size()) parts.id_to_bytes.resize(static_cast<size_t>(id) + 1);
    std::string raw;
    // A token outside the byte mapping can never come out of the model; it decodes as
    // its UTF-8 text, as the ByteLevel decoder does.
    if (token_to_bytes(token, raw)) bytes.find_or_insert(raw, id);
    else raw = token;
    parts.id_to_bytes[static_cast<size_t>(id)] = std::move(raw);
  });
  auto id_of = [&](const std::string& token) {
    const int64_t i = mapped.find(token);
    return i < 0 ? -1 : static_cast<int32_t>(mapped.value(static_cast<size_t>(i)));
  };
  std::vector<BpeModel::Merge> merges;
  merges.reserve(merge_list.array_size());
  for (size_t i = 0; i < merge_list.array_size(); ++i) {
    const auto [a, b] = parse_merge(file, merge_list.element(i), i);
    const int32_t left = id_of(a), right = id_of(b), merged = id_of(a + b);
    if (left < 0 || right < 0 || merged < 0)
      fail_file(file, "model.merges[{}] ('{}', '{}') uses a token missing from model.vocab", i, printable(a),
                printable(b));
    merges.push_back({left, right, merged});
  }
  BpeModelOptions options;
  options.ignore_merges = model.boolean_or("ignore_merges", false);
  options.fuse_unk = model.boolean_or("fuse_unk", false);
  options.byte_fallback = model.boolean_or("byte_fallback", false);
  if (const auto unk = model.find("unk_token")) options.unk_id = id_of(unk->string());
  parts.model = std::make_unique<BpeModel>(std::move(bytes), merges, options);

  if (const auto added = root.find("added_tokens")) {
    for (size_t i = 0; i < added->array_size(); ++i) {
      const JsonField t = added->element(i);
      AddedToken a;
      a.id = read_id(t.member("id"), limit);
      const JsonField content = t.member("content");
      a.content = content.string();
      if (a.content.empty()) content.fail("is empty");
      a.special = t.boolean_or("special", false);
      a.single_word = t.boolean_or("single_word", false);
      a.lstrip = t.boolean_or("lstrip", false);
      a.rstrip = t.boolean_or("rstrip", false);
      a.normalized = t.boolean_or("normalized", !a.special);
      parts.added.push_back(std::move(a));
    }
  }
  if (const auto normalizer = root.find("normalizer")) parse_normalizer(file, *normalizer, parts.normalizer, 0);
  if (const auto pre = root.find("pre_tokenizer")) parse_pre_tokenizer(file, *pre, parts.pretokenizer, 0);
  if (!parts.pretokenizer.has_byte_level())
    fail_file(file, "not a byte-level BPE: pre_tokenizer has no ByteLevel step (kiln supports byte-level BPE only)");

  // BOS/EOS/PAD: tokenizer_config.json beside the file, else well-known names.
  auto token_id = [&](const std::string& content) -> int32_t {
    if (content.empty()) return -1;
    for (const AddedToken& a : parts.added)
      if (a.content == content) return a.id;
    return id_of(content);
  };
  const std::string config_path = (fs::path(file).parent_path() / "tokenizer_config.json").string();
  std::string bos, eos, pad;
  if (fs::is_regular_file(config_path)) {
    const json config_doc = read_json_file(config_path, "tokenizer");
    const JsonField config(config_doc, "tokenizer", config_path);
    bos = config_token(config, "bos_token"), eos = config_token(config, "eos_token"), pad = config_token(config, "pad_token");
    for (const auto& [key, name] : {std::pair{"bos_token", &bos}, {"eos_token", &eos}, {"pad_token", &pad}})
      if (!name->empty() && token_id(*name) < 0) fail_file(config_path, "{} '{}' is not in the vocabulary", key, printable(*name));
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

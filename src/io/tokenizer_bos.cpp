#include "io/tokenizer_bos.h"

#include "core/error.h"

#include <string>

namespace kiln::io {

namespace {

using nlohmann::json;

// The text of token `id`: its added token's content, else its entry in model.vocab.
std::string token_text(const json& tokenizer, int32_t id) {
  if (tokenizer.contains("added_tokens") && tokenizer["added_tokens"].is_array())
    for (const json& a : tokenizer["added_tokens"])
      if (a.is_object() && a.value("id", int64_t{-1}) == id && a.contains("content") && a["content"].is_string())
        return a["content"].get<std::string>();
  if (tokenizer.contains("model") && tokenizer["model"].is_object() && tokenizer["model"].contains("vocab") &&
      tokenizer["model"]["vocab"].is_object())
    for (const auto& [text, value] : tokenizer["model"]["vocab"].items())
      if (value.is_number_integer() && value.get<int64_t>() == id) return text;
  return {};
}

bool template_starts_with(const json& single, const std::string& text) {
  if (!single.is_array() || single.empty() || !single[0].is_object() || !single[0].contains("SpecialToken")) return false;
  const json& special = single[0]["SpecialToken"];
  return special.is_object() && special.value("id", std::string()) == text;
}

bool adds_bos(const json& post, int32_t bos_id, const std::string& bos_text) {
  if (!post.is_object()) return false;
  const std::string type = post.value("type", std::string());
  if (type == "TemplateProcessing") return post.contains("single") && template_starts_with(post["single"], bos_text);
  if (type == "RobertaProcessing" || type == "BertProcessing") {
    const json& cls = post.contains("cls") ? post["cls"] : json();
    return cls.is_array() && cls.size() == 2 && cls[1].is_number_integer() && cls[1].get<int64_t>() == bos_id;
  }
  if (type == "Sequence" && post.contains("processors") && post["processors"].is_array())
    for (const json& p : post["processors"])
      if (adds_bos(p, bos_id, bos_text)) return true;
  return false;
}

}  // namespace

bool tokenizer_adds_bos(const json& tokenizer, int32_t bos_id) {
  const std::string bos = token_text(tokenizer, bos_id);
  return !bos.empty() && tokenizer.contains("post_processor") && adds_bos(tokenizer["post_processor"], bos_id, bos);
}

json with_bos_post_processor(json tokenizer, int32_t bos_id, const std::string& where) {
  const std::string bos = token_text(tokenizer, bos_id);
  KILN_CHECK(!bos.empty(), "export", "{}: the BOS id {} is neither an added token nor in model.vocab", where, bos_id);
  const json post = tokenizer.contains("post_processor") ? tokenizer["post_processor"] : json();
  if (adds_bos(post, bos_id, bos)) return tokenizer;
  const json bos_piece = {{"SpecialToken", {{"id", bos}, {"type_id", 0}}}};
  const json bos_piece_b = {{"SpecialToken", {{"id", bos}, {"type_id", 1}}}};
  const json add_bos = {
      {"type", "TemplateProcessing"},
      {"single", {bos_piece, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
      {"pair", {bos_piece, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}, bos_piece_b,
                {{"Sequence", {{"id", "B"}, {"type_id", 1}}}}}},
      {"special_tokens", {{bos, {{"id", bos}, {"ids", {bos_id}}, {"tokens", {bos}}}}}}};
  tokenizer["post_processor"] =
      post.is_object() ? json{{"type", "Sequence"}, {"processors", {post, add_bos}}} : add_bos;
  return tokenizer;
}

}  // namespace kiln::io

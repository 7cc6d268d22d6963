#include "serve/chat_template.h"

#include "core/error.h"
#include "serve/completion_api.h"

#include <fmt/format.h>
#include <minja/chat-template.hpp>

#include <filesystem>
#include <fstream>

namespace kiln::serve {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

// A special token as tokenizer_config.json names it: a string or {"content": "..."}.
std::string token_named(const json& config, const char* key) {
  if (!config.contains(key)) return "";
  const json& v = config[key];
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string()) return v["content"].get<std::string>();
  return "";
}

}  // namespace

ChatTemplate ChatTemplate::kiln_default() {
  ChatTemplate t = jinja(kDefaultChatTemplate, "", "", "kiln's default chat template");
  t.adds_bos_ = true;
  return t;
}

ChatTemplate ChatTemplate::jinja(const std::string& source, const std::string& bos_token, const std::string& eos_token,
                                 const std::string& origin) {
  ChatTemplate t;
  t.origin_ = origin;
  try {
    t.template_ = std::make_shared<const minja::chat_template>(source, bos_token, eos_token);
  } catch (const std::exception& e) {
    throw Error(fmt::format("[serve] {}: chat_template does not parse: {}", origin, first_line(e.what())));
  }
  return t;
}

ChatTemplate ChatTemplate::for_model(const std::string& tokenizer_config_dir) {
  const fs::path path = fs::path(tokenizer_config_dir) / "tokenizer_config.json";
  if (tokenizer_config_dir.empty() || !fs::exists(path)) return kiln_default();
  json config;
  try {
    config = json::parse(std::ifstream(path));
  } catch (const json::exception& e) {
    throw Error(fmt::format("[serve] {}: not JSON: {}", path.string(), first_line(e.what())));
  }
  if (!config.is_object() || !config.contains("chat_template") || config["chat_template"].is_null())
    return kiln_default();
  const json& c = config["chat_template"];
  std::string source;
  if (c.is_string()) {
    source = c.get<std::string>();
  } else if (c.is_array()) {  // [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
    for (const json& named : c)
      if (named.is_object() && named.contains("name") && named["name"] == "default" && named.contains("template") &&
          named["template"].is_string())
        source = named["template"].get<std::string>();
    if (source.empty())
      throw Error(fmt::format("[serve] {}: chat_template is a list without a 'default' template", path.string()));
  } else {
    throw Error(fmt::format("[serve] {}: chat_template must be a string or a list of named templates", path.string()));
  }
  return jinja(source, token_named(config, "bos_token"), token_named(config, "eos_token"), path.string());
}

std::string ChatTemplate::render(const json& messages) const {
  minja::chat_template_inputs inputs;
  inputs.messages = messages;
  inputs.add_generation_prompt = true;
  minja::chat_template_options options;
  options.apply_polyfills = false;  // the template's own output, as transformers renders it
  try {
    return template_->apply(inputs, options);
  } catch (const std::exception& e) {
    throw ApiError(400, fmt::format("the chat template ({}) refused the messages: {}", origin_, first_line(e.what())),
                   "messages");
  }
}

}  // namespace kiln::serve

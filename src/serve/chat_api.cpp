#include "serve/chat_api.h"

#include <fmt/format.h>

#include <set>

namespace kiln::serve {

using nlohmann::json;

namespace {

// Fields a chat request shares with a completion one, passed on to parse_completion_request.
const std::set<std::string> kSharedFields = {
    "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
    "repetition_penalty", "stop", "seed", "n", "stream", "stream_options", "ignore_eos", "user",
    "presence_penalty", "frequency_penalty", "logit_bias"};
// Chat's own, handled here.
const std::set<std::string> kChatFields = {"messages", "logprobs", "top_logprobs", "response_format"};

bool present(const json& body, const char* key) { return body.contains(key) && !body[key].is_null(); }

// `v` to one level: its elements kept where they are scalars, emptied where they are
// containers. Every field passed on is a scalar or holds scalars (stop, logit_bias,
// stream_options), so the completion parser answers the copy as it would the original; a
// whole copy of a value nested 300000 deep overflowed the stack (the fuzz corpus's
// regression_deep_array).
json shallow(const json& v) {
  if (v.is_primitive()) return v;
  json out = v.is_array() ? json::array() : json::object();
  auto level = [](const json& x) { return x.is_primitive() ? x : x.is_array() ? json::array() : json::object(); };
  if (v.is_array())
    for (const json& x : v) out.push_back(level(x));
  else
    for (const auto& [key, x] : v.items()) out[key] = level(x);
  return out;
}

bool is_text_part(const json& part) {
  return part.is_object() && part.contains("type") && part["type"] == "text" && part.contains("text") &&
         part["text"].is_string();
}

// A message's content as one string: a string, or OpenAI's list of parts, all text.
std::string message_text(const json& content, size_t i) {
  const std::string where = fmt::format("messages[{}].content", i);
  if (content.is_string()) return content.get<std::string>();
  if (content.is_array()) {
    std::string text;
    for (const json& part : content) {
      if (!is_text_part(part))
        throw ApiError(400, fmt::format("'{}' parts must be {{\"type\": \"text\", \"text\": ...}}: kiln's models read "
                                        "text only", where), "messages");
      text += part["text"].get<std::string>();
    }
    return text;
  }
  throw ApiError(400, fmt::format("'{}' must be a string or a list of text parts", where), "messages");
}

// The messages as the template sees them: {role, content} with content a string.
json template_messages(const json& body) {
  if (!present(body, "messages")) throw ApiError(400, "missing field 'messages'", "messages");
  const json& m = body["messages"];
  if (!m.is_array() || m.empty()) throw ApiError(400, "'messages' must be a non-empty list of messages", "messages");
  json out = json::array();
  for (size_t i = 0; i < m.size(); ++i) {
    if (!m[i].is_object() || !m[i].contains("role") || !m[i]["role"].is_string())
      throw ApiError(400, fmt::format("'messages[{}]' must be an object with a 'role'", i), "messages");
    const std::string role = m[i]["role"].get<std::string>();
    if (role != "system" && role != "user" && role != "assistant")
      throw ApiError(400, fmt::format("'messages[{}].role' is '{}': kiln takes system, user and assistant", i,
                                      role.substr(0, 32)), "messages");
    if (!m[i].contains("content")) throw ApiError(400, fmt::format("'messages[{}]' has no 'content'", i), "messages");
    out.push_back({{"role", role}, {"content", message_text(m[i]["content"], i)}});
  }
  return out;
}

void check_response_format(const json& body) {
  if (!present(body, "response_format")) return;
  const json& f = body["response_format"];
  if (!f.is_object() || !f.contains("type") || !f["type"].is_string())
    throw ApiError(400, "'response_format' must be an object with a 'type'", "response_format");
  const std::string type = f["type"].get<std::string>();
  if (type != "text")
    throw ApiError(400, fmt::format("'response_format' type '{}' is not supported: kiln does not constrain its output "
                                    "(only {{\"type\": \"text\"}})", type.substr(0, 32)), "response_format");
}

}  // namespace

CompletionRequest parse_chat_request(const json& body, const Tokenizer& tokenizer, const ChatTemplate& chat_template,
                                     const ApiLimits& limits, uint64_t default_seed) {
  if (!body.is_object()) throw ApiError(400, "the request body must be a JSON object");
  json completion = json::object();
  std::vector<std::string> ignored;
  for (const auto& [key, value] : body.items()) {
    if (kSharedFields.count(key)) completion[key] = shallow(value);
    else if (!kChatFields.count(key)) ignored.push_back(key);
  }
  check_response_format(body);
  // Chat's logprobs is a flag, its alternatives top_logprobs: completions' logprobs is the count.
  if (present(body, "logprobs") && !body["logprobs"].is_boolean())
    throw ApiError(400, "'logprobs' must be true or false", "logprobs");
  const bool logprobs = present(body, "logprobs") && body["logprobs"].get<bool>();
  if (present(body, "top_logprobs")) {
    if (!logprobs) throw ApiError(400, "'top_logprobs' needs \"logprobs\": true", "top_logprobs");
    const json& t = body["top_logprobs"];
    if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() > limits.max_logprobs)
      throw ApiError(400, fmt::format("'top_logprobs' must be an integer in [0, {}]", limits.max_logprobs),
                     "top_logprobs");
  }
  if (logprobs) completion["logprobs"] = present(body, "top_logprobs") ? body["top_logprobs"] : json(0);
  completion["prompt"] = chat_template.render(template_messages(body));
  ApiLimits l = limits;
  l.add_bos = limits.add_bos && chat_template.adds_bos();
  CompletionRequest r;
  try {
    r = parse_completion_request(completion, tokenizer, l, default_seed);
  } catch (const ApiError& e) {  // the prompt is the messages here
    if (e.param != "prompt") throw;
    std::string message = e.what();
    if (const size_t at = message.find("prompt 0 has"); at != std::string::npos)
      message.replace(at, 12, "the messages have");
    throw ApiError(e.status, message, "messages", e.code);
  }
  r.ignored_fields.insert(r.ignored_fields.begin(), ignored.begin(), ignored.end());
  return r;
}

json chat_logprob(const Tokenizer& tokenizer, const TokenLogprob& logprob) {
  auto entry = [&](int32_t token, double value) {
    const std::string piece = tokenizer.decode(std::span<const int32_t>(&token, 1));
    json bytes = json::array();
    for (unsigned char c : piece) bytes.push_back(static_cast<int>(c));
    return json{{"token", token_text(tokenizer, token)}, {"logprob", value}, {"bytes", bytes}};
  };
  json e = entry(logprob.token, logprob.logprob);
  json top = json::array();
  for (const auto& [alt, value] : logprob.top) top.push_back(entry(alt, value));
  e["top_logprobs"] = top;
  return e;
}

json chat_completion_response(const CompletionRequest& request, const std::vector<GenerationResult>& results,
                              const Tokenizer& tokenizer, const std::string& model, const std::string& id,
                              int64_t created) {
  // The usage and each choice's fields are the completion's; the message and logprobs are chat's.
  json out = completion_response(request, results, tokenizer, model, id, created);
  out["object"] = "chat.completion";
  const std::vector<size_t> chosen = answer_sequences(request, results);
  for (size_t i = 0; i < chosen.size(); ++i) {
    const GenerationResult& result = results[chosen[i]];
    json& choice = out["choices"][i];
    choice.erase("text");
    choice["message"] = {{"role", "assistant"}, {"content", result.text}};
    if (!request.logprobs) continue;
    json content = json::array();
    for (const TokenLogprob& lp : result.logprobs) content.push_back(chat_logprob(tokenizer, lp));
    choice["logprobs"] = {{"content", content}};
  }
  return out;
}

}  // namespace kiln::serve

#include "serve/chat_stream.h"

#include "serve/chat_api.h"

namespace kiln::serve {

using nlohmann::json;

ChatChunks::ChatChunks(const CompletionRequest& request, const Tokenizer& tokenizer, std::string id,
                       std::string model, int64_t created)
    : tokenizer_(tokenizer),
      id_(std::move(id)),
      model_(std::move(model)),
      created_(created),
      include_usage_(request.include_usage),
      logprobs_(request.logprobs.has_value()),
      choices_(request.sequences.size()) {}

json ChatChunks::with_choice(size_t index, json delta, json logprobs, const std::string& finish_reason) const {
  json c = {{"id", id_}, {"object", "chat.completion.chunk"}, {"created", created_}, {"model", model_}};
  c["choices"] = json::array({{{"index", index},
                               {"delta", std::move(delta)},
                               {"logprobs", std::move(logprobs)},
                               {"finish_reason", finish_reason.empty() ? json(nullptr) : json(finish_reason)}}});
  if (include_usage_) c["usage"] = nullptr;
  return c;
}

std::vector<json> ChatChunks::opening() {
  std::vector<json> chunks;
  for (size_t i = 0; i < choices_; ++i)
    chunks.push_back(with_choice(i, {{"role", "assistant"}, {"content", ""}}, nullptr, ""));
  return chunks;
}

json ChatChunks::chunk(const TokenFeed::Update& u) {
  json logprobs = nullptr;
  if (logprobs_) {  // the generated tokens only, as unstreamed (chat lists no EOS)
    json content = json::array();
    for (const TokenLogprob& lp : u.logprobs) content.push_back(chat_logprob(tokenizer_, lp));
    logprobs = {{"content", std::move(content)}};
  }
  return with_choice(u.index, u.text.empty() ? json::object() : json{{"content", u.text}}, std::move(logprobs),
                     u.finish_reason);
}

json ChatChunks::usage_chunk(int64_t prompt_tokens, int64_t completion_tokens) {
  json c = {{"id", id_}, {"object", "chat.completion.chunk"}, {"created", created_}, {"model", model_}};
  c["choices"] = json::array();
  c["usage"] = usage_json(prompt_tokens, completion_tokens);
  return c;
}

}  // namespace kiln::serve

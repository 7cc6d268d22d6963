#include "serve/chat_stream.h"

namespace kiln::serve {

using nlohmann::json;

ChatChunks::ChatChunks(const CompletionRequest& request, std::string id, std::string model, int64_t created)
    : id_(std::move(id)),
      model_(std::move(model)),
      created_(created),
      include_usage_(request.include_usage),
      choices_(request.sequences.size()) {}

json ChatChunks::with_choice(size_t index, json delta, const std::string* finish_reason) const {
  json c = {{"id", id_}, {"object", "chat.completion.chunk"}, {"created", created_}, {"model", model_}};
  c["choices"] = json::array({{{"index", index},
                               {"delta", std::move(delta)},
                               {"logprobs", nullptr},
                               {"finish_reason", finish_reason ? json(*finish_reason) : json(nullptr)}}});
  if (include_usage_) c["usage"] = nullptr;
  return c;
}

std::vector<json> ChatChunks::opening() {
  std::vector<json> chunks;
  for (size_t i = 0; i < choices_; ++i) chunks.push_back(with_choice(i, {{"role", "assistant"}, {"content", ""}}, nullptr));
  return chunks;
}

json ChatChunks::chunk(size_t index, const std::string& text, const std::string* finish_reason) {
  return with_choice(index, text.empty() ? json::object() : json{{"content", text}}, finish_reason);
}

json ChatChunks::usage_chunk(int64_t prompt_tokens, int64_t completion_tokens) {
  json c = {{"id", id_}, {"object", "chat.completion.chunk"}, {"created", created_}, {"model", model_}};
  c["choices"] = json::array();
  c["usage"] = usage_json(prompt_tokens, completion_tokens);
  return c;
}

}  // namespace kiln::serve

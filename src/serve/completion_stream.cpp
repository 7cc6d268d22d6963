#include "serve/completion_stream.h"

namespace kiln::serve {

using nlohmann::json;

CompletionChunks::CompletionChunks(const CompletionRequest& request, std::string id, std::string model,
                                   int64_t created)
    : id_(std::move(id)), model_(std::move(model)), created_(created), include_usage_(request.include_usage) {
  // Indexed by choice: each of a prompt's n choices starts with its text.
  if (request.echo)
    for (const std::string& text : request.prompt_texts) echo_.insert(echo_.end(), static_cast<size_t>(request.n), text);
}

json CompletionChunks::base() const {
  return {{"id", id_}, {"object", "text_completion"}, {"created", created_}, {"model", model_}};
}

json CompletionChunks::chunk(size_t index, const std::string& text, const std::string* finish_reason) {
  std::string shown = text;
  if (index < echo_.size()) shown = std::exchange(echo_[index], std::string()) + text;
  json c = base();
  c["choices"] = json::array({{{"index", index},
                               {"text", shown},
                               {"logprobs", nullptr},
                               {"finish_reason", finish_reason ? json(*finish_reason) : json(nullptr)}}});
  if (include_usage_) c["usage"] = nullptr;
  return c;
}

json CompletionChunks::usage_chunk(int64_t prompt_tokens, int64_t completion_tokens) {
  json c = base();
  c["choices"] = json::array();
  c["usage"] = usage_json(prompt_tokens, completion_tokens);
  return c;
}

}  // namespace kiln::serve

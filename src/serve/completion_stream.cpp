#include "serve/completion_stream.h"

namespace kiln::serve {

using nlohmann::json;

CompletionChunks::CompletionChunks(const CompletionRequest& request, const Tokenizer& tokenizer, std::string id,
                                   std::string model, int64_t created)
    : tokenizer_(tokenizer),
      id_(std::move(id)),
      model_(std::move(model)),
      created_(created),
      include_usage_(request.include_usage),
      logprobs_(request.logprobs.has_value()) {
  // Indexed by choice: each of a prompt's n choices starts with its text.
  if (request.echo)
    for (const std::string& text : request.prompt_texts) echo_.insert(echo_.end(), static_cast<size_t>(request.n), text);
}

json CompletionChunks::base() const {
  return {{"id", id_}, {"object", "text_completion"}, {"created", created_}, {"model", model_}};
}

json CompletionChunks::chunk(const TokenFeed::Update& u) {
  std::string shown = u.text;
  if (u.index < echo_.size()) shown = std::exchange(echo_[u.index], std::string()) + u.text;
  json logprobs = nullptr;
  if (logprobs_) {
    if (u.index >= offset_.size()) offset_.resize(u.index + 1, 0);
    int64_t& offset = offset_[u.index];
    logprobs = legacy_logprobs();
    for (const TokenLogprob& lp : u.prompt_logprobs) append_logprob(logprobs, tokenizer_, lp.token, &lp, offset);
    for (const TokenLogprob& lp : u.logprobs) append_logprob(logprobs, tokenizer_, lp.token, &lp, offset);
    if (u.eos_logprob) append_logprob(logprobs, tokenizer_, u.eos_logprob->token, &*u.eos_logprob, offset);
  }
  json c = base();
  c["choices"] = json::array({{{"index", u.index},
                               {"text", shown},
                               {"logprobs", std::move(logprobs)},
                               {"finish_reason", u.finish_reason.empty() ? json(nullptr) : json(u.finish_reason)}}});
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

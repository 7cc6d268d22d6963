// The chunks of a streamed POST /v1/chat/completions, as OpenAI's API sends them:
//   {"id", "object": "chat.completion.chunk", "created", "model",
//    "choices": [{"index", "delta": {...}, "logprobs": null, "finish_reason"}]}
// First, before any text, each choice's delta {"role": "assistant", "content": ""}; then
// deltas {"content": text}; a choice's last chunk has its finish_reason (and delta {} when
// no text came with it). Usage as for completions (serve/completion_stream.h).
#pragma once

#include "serve/completion_api.h"
#include "serve/event_stream.h"

#include <string>

namespace kiln::serve {

class ChatChunks final : public ChunkFormat {
 public:
  ChatChunks(const CompletionRequest& request, std::string id, std::string model, int64_t created);
  std::vector<nlohmann::json> opening() override;
  nlohmann::json chunk(size_t index, const std::string& text, const std::string* finish_reason) override;
  nlohmann::json usage_chunk(int64_t prompt_tokens, int64_t completion_tokens) override;

 private:
  nlohmann::json with_choice(size_t index, nlohmann::json delta, const std::string* finish_reason) const;

  std::string id_, model_;
  int64_t created_;
  bool include_usage_;
  size_t choices_;
};

}  // namespace kiln::serve

// The chunks of a streamed POST /v1/chat/completions, as OpenAI's API sends them:
//   {"id", "object": "chat.completion.chunk", "created", "model",
//    "choices": [{"index", "delta": {...}, "logprobs": null, "finish_reason"}]}
// First, before any text, each choice's delta {"role": "assistant", "content": ""}; then
// deltas {"content": text}; a choice's last chunk has its finish_reason (and delta {} when
// no text came with it). Usage as for completions (serve/completion_stream.h). With
// "logprobs": true, each chunk after the role's has logprobs {"content": [...]} of the
// tokens it brings (chat_logprob's entries; the role's chunk has null), so the chunks'
// lists joined are the unstreamed answer's.
#pragma once

#include "serve/completion_api.h"
#include "serve/event_stream.h"

#include <string>

namespace kiln::serve {

class ChatChunks final : public ChunkFormat {
 public:
  ChatChunks(const CompletionRequest& request, const Tokenizer& tokenizer, std::string id, std::string model,
             int64_t created);
  std::vector<nlohmann::json> opening() override;
  using ChunkFormat::chunk;
  nlohmann::json chunk(const TokenFeed::Update& u) override;
  nlohmann::json usage_chunk(int64_t prompt_tokens, int64_t completion_tokens) override;

 private:
  nlohmann::json with_choice(size_t index, nlohmann::json delta, nlohmann::json logprobs,
                             const std::string& finish_reason) const;

  const Tokenizer& tokenizer_;
  std::string id_, model_;
  int64_t created_;
  bool include_usage_;
  bool logprobs_;
  size_t choices_;
};

}  // namespace kiln::serve

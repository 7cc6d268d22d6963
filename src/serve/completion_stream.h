// The chunks of a streamed POST /v1/completions, as OpenAI's API sends them:
//   {"id", "object": "text_completion", "created", "model",
//    "choices": [{"index", "text", "logprobs": null, "finish_reason"}]}
// finish_reason null but on each choice's last chunk; with stream_options.include_usage
// every chunk has "usage": null and a last one has the usage and no choices. With echo,
// a choice's first chunk starts with its prompt's text.
#pragma once

#include "serve/completion_api.h"
#include "serve/event_stream.h"

#include <string>
#include <vector>

namespace kiln::serve {

class CompletionChunks final : public ChunkFormat {
 public:
  CompletionChunks(const CompletionRequest& request, std::string id, std::string model, int64_t created);
  nlohmann::json chunk(size_t index, const std::string& text, const std::string* finish_reason) override;
  nlohmann::json usage_chunk(int64_t prompt_tokens, int64_t completion_tokens) override;

 private:
  nlohmann::json base() const;

  std::string id_, model_;
  int64_t created_;
  bool include_usage_;
  std::vector<std::string> echo_;  // each choice's prompt text, until its first chunk (with echo)
};

}  // namespace kiln::serve

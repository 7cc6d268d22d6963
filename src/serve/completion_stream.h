// The chunks of a streamed POST /v1/completions, as OpenAI's API sends them:
//   {"id", "object": "text_completion", "created", "model",
//    "choices": [{"index", "text", "logprobs", "finish_reason"}]}
// finish_reason null but on each choice's last chunk; with stream_options.include_usage
// every chunk has "usage": null and a last one has the usage and no choices. With echo,
// a choice's first chunk starts with its prompt's text. logprobs is null unless asked;
// then each chunk has the legacy object {tokens, token_logprobs, top_logprobs,
// text_offset} of the tokens it brings (the prompt's first with echo, the ending EOS's
// last), text_offset counted from the choice's start as unstreamed: the chunks' lists
// joined are the unstreamed answer's.
#pragma once

#include "serve/completion_api.h"
#include "serve/event_stream.h"

#include <string>
#include <vector>

namespace kiln::serve {

class CompletionChunks final : public ChunkFormat {
 public:
  CompletionChunks(const CompletionRequest& request, const Tokenizer& tokenizer, std::string id, std::string model,
                   int64_t created);
  using ChunkFormat::chunk;
  nlohmann::json chunk(const TokenFeed::Update& u) override;
  nlohmann::json usage_chunk(int64_t prompt_tokens, int64_t completion_tokens) override;

 private:
  nlohmann::json base() const;

  const Tokenizer& tokenizer_;
  std::string id_, model_;
  int64_t created_;
  bool include_usage_;
  bool logprobs_;
  std::vector<std::string> echo_;  // each choice's prompt text, until its first chunk (with echo)
  std::vector<int64_t> offset_;    // each choice's text_offset so far (with logprobs)
};

}  // namespace kiln::serve

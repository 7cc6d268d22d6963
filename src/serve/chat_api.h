// POST /v1/chat/completions: OpenAI's chat API on the completions machinery. A chat request
// is checked for what is chat's own (messages, logprobs as a flag with top_logprobs,
// response_format), its messages rendered to one prompt by the model's chat template
// (serve/chat_template.h), and the rest parsed as the completion of that prompt would be
// (parse_completion_request: the same sampling fields, limits and refusals). The answer is
// chat's shape: choices[].message {role: "assistant", content}, logprobs.content[].
//
// Accepted: model, messages ([{role: system | user | assistant, content: string or
// [{type: "text", text}]}]), max_tokens / max_completion_tokens, temperature, top_p, top_k,
// min_p, repetition_penalty, presence_penalty, frequency_penalty, logit_bias, stop, seed,
// logprobs (bool), top_logprobs (0..20, with logprobs), n (1), stream, stream_options,
// ignore_eos, user, response_format ({"type": "text"}; other types are 400 naming it).
#pragma once

#include "serve/chat_template.h"
#include "serve/completion_api.h"

namespace kiln::serve {

// Throws ApiError(400, ...) naming the field; the request's one sequence is the rendered prompt's.
CompletionRequest parse_chat_request(const nlohmann::json& body, const Tokenizer& tokenizer,
                                     const ChatTemplate& chat_template, const ApiLimits& limits,
                                     uint64_t default_seed);

nlohmann::json chat_completion_response(const CompletionRequest& request, const std::vector<GenerationResult>& results,
                                        const Tokenizer& tokenizer, const std::string& model, const std::string& id,
                                        int64_t created);

// One generated token as chat's logprobs list it: {token, logprob, bytes, top_logprobs:
// [{token, logprob, bytes}]} (bytes: the token's UTF-8 bytes as numbers).
nlohmann::json chat_logprob(const Tokenizer& tokenizer, const TokenLogprob& logprob);

}  // namespace kiln::serve

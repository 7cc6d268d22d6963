// The OpenAI-compatible completions API of `kiln serve`: request validation and response
// formatting, apart from HTTP (serve/server.h) so tests can check them directly.
//
// POST /v1/completions accepts (unknown fields are a 400 that names them):
//   model (string, any), prompt (string | [string] | [int] | [[int]]), max_tokens (>= 0,
//   default 16), temperature (>= 0, default 1), top_p, top_k, min_p, repetition_penalty,
//   stop (string | [string]), seed, echo, logprobs (null | 0..max), n / best_of (1 only),
//   stream (false only), ignore_eos, user, presence_penalty / frequency_penalty (0 only),
//   logit_bias (empty only), suffix (null only).
// String prompts are tokenized with BOS first (as kiln trains); id prompts are taken as
// given. The legacy logprobs object {tokens, token_logprobs, top_logprobs, text_offset}
// covers the prompt too when echo is set (first entry null), which is what
// lm-evaluation-harness's local-completions reads for loglikelihood (max_tokens 0 or 1).
#pragma once

#include "data/tokenizer.h"
#include "infer/generator.h"

#include <nlohmann/json.hpp>

#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace kiln::serve {

// A client error: HTTP status (400, 404, 413, 422, 503 ...) and a message.
struct ApiError : std::runtime_error {
  ApiError(int status, const std::string& message, std::string param = "")
      : std::runtime_error(message), status(status), param(std::move(param)) {}
  int status;
  std::string param;
};

struct ApiLimits {
  int64_t context = 0;          // tokens per sequence (prompt + max_tokens)
  int64_t vocab = 0;            // token ids accepted: [0, vocab)
  int64_t max_prompts = 1024;   // prompts in one request
  int64_t max_logprobs = 20;    // logprobs / top alternatives
  bool add_bos = true;          // BOS before string prompts
  // /tokenize and /detokenize are not bounded by the context (they count and cut prompts
  // that are too long), so by these: a 16 MiB text used to become 16M ids held as a JSON
  // array, about 700 MB for one request.
  int64_t max_tokenize_bytes = int64_t(1) << 20;  // text bytes per /tokenize request (413 above)
  int64_t max_detokenize_ids = int64_t(1) << 18;  // ids per /detokenize request (413 above)
};

struct CompletionRequest {
  std::vector<GenerationRequest> sequences;  // one per prompt
  std::vector<std::string> prompt_texts;     // each prompt's text (for echo)
  bool echo = false;
  std::optional<int64_t> logprobs;           // null = no logprobs object
};

// Parses and validates a request body (already JSON). Throws ApiError(400, ...).
CompletionRequest parse_completion_request(const nlohmann::json& body, const Tokenizer& tokenizer,
                                           const ApiLimits& limits, uint64_t default_seed);

nlohmann::json completion_response(const CompletionRequest& request, const std::vector<GenerationResult>& results,
                                   const Tokenizer& tokenizer, const std::string& model, const std::string& id,
                                   int64_t created);

// POST /tokenize {"prompt": "text", "add_special_tokens": true} -> {"tokens", "count", "max_model_len"},
// the answer's JSON text: the ids are written straight into it (as a JSON array each id
// was a 16-byte value, four times the ids themselves, before the text was even made).
// A prompt over limits.max_tokenize_bytes is ApiError 413 naming 'prompt'.
std::string tokenize_response(const nlohmann::json& body, const Tokenizer& tokenizer, const ApiLimits& limits);
// POST /detokenize {"tokens": [ids]} -> {"prompt": "text"}; over limits.max_detokenize_ids
// ids is ApiError 413 naming 'tokens'.
nlohmann::json detokenize_response(const nlohmann::json& body, const Tokenizer& tokenizer, const ApiLimits& limits);
// The error for a /detokenize body with more than limits.max_detokenize_ids ids (the
// server raises it while parsing, before the ids are held as JSON values).
ApiError too_many_detokenize_ids(const ApiLimits& limits);

// A token as logprobs show it: its text when that is valid UTF-8, special tokens by name,
// otherwise "bytes:\xNN..." (so every id has a distinct, valid JSON string).
std::string token_text(const Tokenizer& tokenizer, int32_t id);

nlohmann::json error_body(int status, const std::string& message, const std::string& param = "");

}  // namespace kiln::serve

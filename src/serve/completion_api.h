// The OpenAI-compatible completions API of `kiln serve`: request validation and response
// formatting, apart from HTTP (serve/server.h) so tests can check them directly.
//
// POST /v1/completions accepts:
//   model (string: a served name, else 404 model_not_found; check_model), prompt (string |
//   [string] | [int] | [[int]]), max_tokens or max_completion_tokens (>= 0, default 16),
//   temperature (>= 0, default 1), top_p, top_k, min_p, repetition_penalty,
//   presence_penalty and frequency_penalty ([-2, 2], OpenAI's), logit_bias ({"id": bias in
//   [-100, 100]}), stop (string | [string]), seed, echo, logprobs (null | 0..max), stream,
//   stream_options {include_usage}, ignore_eos, user, n (choices per prompt) and best_of
//   (sequences generated per prompt, >= n; not above n with stream), and, where it changes
//   nothing, suffix (null or ""): other values of that are a 400 naming it. Fields it does
//   not know are ignored and listed in ignored_fields (the server logs them).
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
  ApiError(int status, const std::string& message, std::string param = "", std::string code = "")
      : std::runtime_error(message), status(status), param(std::move(param)), code(std::move(code)) {}
  int status;
  std::string param;
  std::string code;  // OpenAI's error code ("model_not_found"); empty: the status
};

struct ApiLimits {
  int64_t context = 0;          // tokens per sequence (prompt + max_tokens)
  int64_t vocab = 0;            // token ids accepted: [0, vocab)
  int64_t max_prompts = 1024;   // prompts in one request
  int64_t max_logprobs = 20;    // logprobs / top alternatives
  // The sequences of one prompt (best_of, else n) run at once, one slot each: at most
  // `slots` (the decoder's; 0 = unbounded). A request's sequences in all: at most
  // `max_sequences` (the worker's queue bound; 0 = unbounded). Past either it is a 400
  // naming the field, not a 503 that no retry would get past.
  int64_t slots = 0;
  int64_t max_sequences = 0;
  bool add_bos = true;          // BOS before string prompts
  // /tokenize and /detokenize are not bounded by the context (they count and cut prompts
  // that are too long), so by these: a 16 MiB text used to become 16M ids held as a JSON
  // array, about 700 MB for one request.
  int64_t max_tokenize_bytes = int64_t(1) << 20;  // text bytes per /tokenize request (413 above)
  int64_t max_detokenize_ids = int64_t(1) << 18;  // ids per /detokenize request (413 above)
};

struct CompletionRequest {
  // best_of per prompt, prompt-major: sequence k is prompt k / best_of's, seeded seed + k
  // (so with n = 1 and one prompt, choice 0 is the request's seed), and each but the
  // first of a prompt shares the first's prefill (GenerationRequest::shares_prefill).
  std::vector<GenerationRequest> sequences;
  std::vector<std::string> prompt_texts;     // each prompt's text (for echo)
  int64_t n = 1;                             // choices per prompt
  int64_t best_of = 1;                       // sequences per prompt (>= n; == n when streaming)
  bool echo = false;
  std::optional<int64_t> logprobs;           // null = no logprobs object
  bool stream = false;                       // answer as server-sent events (serve/completion_stream.h)
  bool include_usage = false;                // stream_options.include_usage
  std::vector<std::string> ignored_fields;   // fields not known, ignored ("stream_options.x" inside it)
};

// Parses and validates a request body (already JSON). Throws ApiError(400, ...).
CompletionRequest parse_completion_request(const nlohmann::json& body, const Tokenizer& tokenizer,
                                           const ApiLimits& limits, uint64_t default_seed);

// OpenAI's usage object: prompt, completion and total tokens.
nlohmann::json usage_json(int64_t prompt_tokens, int64_t completion_tokens);

// The answer's choices, in order: the sequence each one is. All sequences, unless best_of
// > n: then each prompt's n sequences with the highest mean_logprob, best first (ties: the
// earlier sequence).
std::vector<size_t> answer_sequences(const CompletionRequest& request, const std::vector<GenerationResult>& results);
// best_of's rank, OpenAI's documented rule ("the highest log probability per token"): the
// mean of the model's own logprobs (as `logprobs` reports them) of the tokens drawn, an
// ending EOS among them; 0 for a sequence that drew none.
double mean_logprob(const GenerationResult& result);
// Prompt tokens as usage counts them: each prompt once, however many sequences share it.
int64_t prompt_tokens(const std::vector<GenerationRequest>& sequences);

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

// OpenAI's legacy logprobs object {tokens, token_logprobs, top_logprobs, text_offset},
// empty, and one token added to it (`logprob` null or NaN: null entries, as for a prompt's
// first token). `offset` is the token's text_offset, the bytes of the choice's text before
// it, and moves past the token: a stream carries it from chunk to chunk.
nlohmann::json legacy_logprobs();
void append_logprob(nlohmann::json& logprobs, const Tokenizer& tokenizer, int32_t token, const TokenLogprob* logprob,
                    int64_t& offset);

// A token as logprobs show it: its text when that is valid UTF-8, special tokens by name,
// otherwise "bytes:\xNN..." (so every id has a distinct, valid JSON string).
std::string token_text(const Tokenizer& tokenizer, int32_t id);

nlohmann::json error_body(int status, const std::string& message, const std::string& param = "",
                          const std::string& code = "");

// A request's `model`, when given, must be one of `served` (the served name first):
// otherwise ApiError 404 with OpenAI's code model_not_found.
void check_model(const nlohmann::json& body, const std::vector<std::string>& served);
ApiError model_not_found(const std::string& name, const std::string& served);

}  // namespace kiln::serve

// Fuzz target: the request parser of `kiln serve` (serve/completion_api.h), as the
// server runs it on a body: JSON parse, then parse_completion_request (and the /tokenize
// and /detokenize parsers, and parse_chat_request with kiln's default chat template, on the
// same body) with the byte tokenizer and a small model's
// limits. A refusal is an ApiError (or a one-line kiln::Error; the server answers 400 to
// both); anything else would be a 500 or a crash. A request that parses is inside the
// limits: prompts non-empty, ids in the vocabulary, prompt + max_tokens within the context.
#include "../fuzz_target.h"
#include "../served.h"

#include "serve/chat_api.h"
#include "serve/completion_api.h"

KILN_FUZZ_TARGET(completion_request) {
  using namespace kiln;
  nlohmann::json body;
  try {
    body = nlohmann::json::parse(input);
  } catch (const nlohmann::json::exception&) {
    return;  // the server's 400 "malformed JSON body"
  }
  static const ByteTokenizer tokenizer;
  serve::ApiLimits limits;
  limits.context = 64;
  limits.vocab = tokenizer.vocab_size();
  limits.max_prompts = 8;
  limits.slots = 4;           // best_of (else n) sequences of a prompt at once
  limits.max_sequences = 16;  // prompts x best_of in all
  auto check = [&](const serve::CompletionRequest& request) {
    KILN_FUZZ_CHECK(!request.sequences.empty(), "a request without sequences");
    const auto sequences = static_cast<int64_t>(request.sequences.size());
    KILN_FUZZ_CHECK(request.best_of >= request.n && request.n >= 1, "best_of below n");
    KILN_FUZZ_CHECK(request.best_of <= limits.slots, "more sequences per prompt than slots");
    KILN_FUZZ_CHECK(sequences % request.best_of == 0, "a prompt without its best_of sequences");
    KILN_FUZZ_CHECK(sequences / request.best_of <= limits.max_prompts, "too many prompts");
    KILN_FUZZ_CHECK(sequences <= limits.max_sequences, "more sequences than the queue takes");
    for (const GenerationRequest& g : request.sequences) {
      KILN_FUZZ_CHECK(!g.prompt.empty(), "an empty prompt");
      KILN_FUZZ_CHECK(static_cast<int64_t>(g.prompt.size()) + g.max_tokens <= limits.context, "over the context");
      for (const int32_t id : g.prompt) KILN_FUZZ_CHECK(id >= 0 && id < limits.vocab, "a prompt id outside the vocabulary");
    }
  };
  serve::CompletionRequest request;
  if (fuzz::served([&] { request = serve::parse_completion_request(body, tokenizer, limits, 17); })) check(request);
  static const serve::ChatTemplate chat_template = serve::ChatTemplate::kiln_default();
  if (fuzz::served([&] { request = serve::parse_chat_request(body, tokenizer, chat_template, limits, 17); }))
    check(request);
  fuzz::served([&] { serve::tokenize_response(body, tokenizer, limits); });
  fuzz::served([&] { serve::detokenize_response(body, tokenizer, limits); });
}

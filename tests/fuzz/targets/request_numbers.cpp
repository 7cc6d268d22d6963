// Fuzz target: how `kiln serve` reads the numbers of a request body (serve/completion_api.h).
// nlohmann keeps JSON integers from 2^63 to 2^64 - 1 as unsigned and parses larger ones as
// doubles, and get<int64_t>() wraps the unsigned ones to negatives: top_k 2^64 - 1 was read
// as -1 and served (issue 38). The property: a request that parses holds exactly the
// numbers sent, every integer field and token id an int64 of the value written, every
// other number the double written; a request holding anything else is refused (ApiError
// 4xx or a one-line kiln::Error), never read as another number.
#include "../fuzz_target.h"
#include "../served.h"

#include "core/json_field.h"
#include "serve/completion_api.h"

#include <string>

namespace {

using nlohmann::json;

bool given(const json& body, const char* key) { return body.contains(key) && !body[key].is_null(); }

// The integer `key` holds, which a request that parsed must have read as one.
int64_t sent_integer(const json& body, const char* key) {
  const std::optional<int64_t> v = kiln::json_int64(body[key]);
  KILN_FUZZ_CHECK(v.has_value(), "a field taken as an integer that is none an int64 holds");
  return *v;
}

// The ids of one prompt as sent; each must be an int64 (and inside the vocabulary).
std::vector<int32_t> sent_ids(const json& prompt, int64_t vocab) {
  std::vector<int32_t> ids;
  for (const json& x : prompt) {
    const std::optional<int64_t> id = kiln::json_int64(x);
    KILN_FUZZ_CHECK(id.has_value() && *id >= 0 && *id < vocab, "an id taken that is not one of the vocabulary");
    ids.push_back(static_cast<int32_t>(*id));
  }
  return ids;
}

void check_completion(const json& body, const kiln::serve::CompletionRequest& request, int64_t vocab) {
  const kiln::GenerationRequest& first = request.sequences.front();
  if (given(body, "max_tokens")) KILN_FUZZ_CHECK(first.max_tokens == sent_integer(body, "max_tokens"), "max_tokens");
  if (given(body, "top_k")) {
    const int64_t top_k = sent_integer(body, "top_k");
    KILN_FUZZ_CHECK(first.sampling.top_k == (top_k < 0 ? 0 : top_k), "top_k");
  }
  if (given(body, "logprobs")) KILN_FUZZ_CHECK(request.logprobs == sent_integer(body, "logprobs"), "logprobs");
  if (given(body, "seed"))
    for (size_t i = 0; i < request.sequences.size(); ++i)
      KILN_FUZZ_CHECK(request.sequences[i].seed == static_cast<uint64_t>(sent_integer(body, "seed")) + i, "seed");
  for (const char* key : {"temperature", "top_p", "min_p", "repetition_penalty"})
    if (given(body, key)) {
      KILN_FUZZ_CHECK(body[key].is_number(), "a number field that is not a number");
      const double sent = body[key].get<double>();
      const auto& s = first.sampling;
      const double read = key == std::string("temperature") ? s.temperature
                          : key == std::string("top_p")     ? s.top_p
                          : key == std::string("min_p")     ? s.min_p
                                                            : s.repetition_penalty;
      KILN_FUZZ_CHECK(read == sent, "a number read as another");
    }
  const json& prompt = body["prompt"];
  if (prompt.is_array() && !prompt.empty() && prompt.front().is_number())
    KILN_FUZZ_CHECK(first.prompt == sent_ids(prompt, vocab), "prompt ids read as others");
  else if (prompt.is_array() && !prompt.empty() && prompt.front().is_array())
    for (size_t i = 0; i < prompt.size(); ++i)
      KILN_FUZZ_CHECK(request.sequences[i].prompt == sent_ids(prompt[i], vocab), "prompt ids read as others");
}

}  // namespace

KILN_FUZZ_TARGET(request_numbers) {
  using namespace kiln;
  json body;
  try {
    body = json::parse(input);
  } catch (const json::exception&) {
    return;  // the server's 400 "malformed JSON body"
  }
  static const ByteTokenizer tokenizer;
  serve::ApiLimits limits;
  limits.context = 64;
  limits.vocab = tokenizer.vocab_size();
  limits.max_prompts = 8;
  serve::CompletionRequest request;
  if (fuzz::served([&] { request = serve::parse_completion_request(body, tokenizer, limits, 17); }))
    check_completion(body, request, limits.vocab);
  json text;
  if (fuzz::served([&] { text = serve::detokenize_response(body, tokenizer, limits); })) {
    const std::vector<int32_t> ids = sent_ids(body["tokens"], limits.vocab);
    KILN_FUZZ_CHECK(text["prompt"] == tokenizer.decode(ids), "detokenized other ids than those sent");
  }
}

#include "serve/completion_api.h"

#include "core/json_field.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <set>

namespace kiln::serve {

using nlohmann::json;

namespace {

// The fields parse_completion_request reads. Any other is ignored (and named in
// CompletionRequest::ignored_fields), as OpenAI-compatible servers do: clients send fields
// newer than the server (metadata, service_tier, ...). A field kiln knows but cannot honour
// (n > 1, suffix) is refused by name instead: ignoring it would silently answer a
// different request.
const std::set<std::string> kCompletionFields = {
    "model", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
    "repetition_penalty", "stop", "seed", "echo", "logprobs", "n", "best_of", "stream", "stream_options",
    "ignore_eos", "user", "presence_penalty", "frequency_penalty", "logit_bias", "suffix"};

void only_fields(const json& body, const std::set<std::string>& known) {
  if (!body.is_object()) throw ApiError(400, "the request body must be a JSON object");
  for (const auto& [key, value] : body.items())
    if (!known.count(key)) throw ApiError(400, fmt::format("unknown field '{}'", key), key);
}

std::vector<std::string> unknown_fields(const json& body, const std::set<std::string>& known) {
  if (!body.is_object()) throw ApiError(400, "the request body must be a JSON object");
  std::vector<std::string> unknown;
  for (const auto& [key, value] : body.items())
    if (!known.count(key)) unknown.push_back(key);
  return unknown;
}

bool present(const json& body, const char* key) { return body.contains(key) && !body[key].is_null(); }

// A wrongly typed value as an error names it: a scalar as written, a container by its type
// (dump() recurses: an array nested 300000 deep in a request overflowed the server's stack).
std::string shown(const json& v) { return v.is_primitive() ? v.dump() : fmt::format("an {}", v.type_name()); }

int64_t get_int(const json& body, const char* key, int64_t fallback, int64_t lo, int64_t hi) {
  if (!present(body, key)) return fallback;
  const json& v = body[key];
  if (!v.is_number_integer()) throw ApiError(400, fmt::format("'{}' must be an integer, got {}", key, shown(v)), key);
  const std::optional<int64_t> x = json_int64(v);  // nullopt from 2^63 up
  if (!x || *x < lo || *x > hi)
    throw ApiError(400, fmt::format("'{}' must be in [{}, {}], got {}", key, lo, hi, shown(v)), key);
  return *x;
}

double get_number(const json& body, const char* key, double fallback, double lo, double hi) {
  if (!present(body, key)) return fallback;
  const json& v = body[key];
  if (!v.is_number()) throw ApiError(400, fmt::format("'{}' must be a number, got {}", key, shown(v)), key);
  const double x = v.get<double>();
  if (!(x >= lo && x <= hi)) throw ApiError(400, fmt::format("'{}' must be in [{}, {}], got {}", key, lo, hi, x), key);
  return x;
}

// OpenAI's logit_bias: {"token id": bias in [-100, 100]}, the ids as decimal strings (JSON
// keys); null or {} for none.
std::vector<std::pair<int32_t, float>> parse_logit_bias(const json& body, int64_t vocab) {
  std::vector<std::pair<int32_t, float>> bias;
  if (!present(body, "logit_bias")) return bias;
  const json& o = body["logit_bias"];
  if (!o.is_object()) throw ApiError(400, "'logit_bias' must be an object of token ids to biases", "logit_bias");
  for (const auto& [key, value] : o.items()) {
    int64_t id = -1;
    const bool digits = !key.empty() && key.size() <= 10 && std::all_of(key.begin(), key.end(), [](char c) {
      return c >= '0' && c <= '9';
    });
    if (digits) id = std::stoll(key);
    if (id < 0 || id >= vocab)
      throw ApiError(400, fmt::format("'logit_bias' keys must be token ids in [0, {}), got '{}'", vocab, key.substr(0, 24)),
                     "logit_bias");
    if (!value.is_number() || !(value.get<double>() >= -100 && value.get<double>() <= 100))
      throw ApiError(400, fmt::format("'logit_bias' values must be numbers in [-100, 100], got {} for '{}'",
                                      shown(value), key),
                     "logit_bias");
    bias.emplace_back(static_cast<int32_t>(id), static_cast<float>(value.get<double>()));
  }
  return bias;
}

bool get_bool(const json& body, const char* key, bool fallback) {
  if (!present(body, key)) return fallback;
  if (!body[key].is_boolean()) throw ApiError(400, fmt::format("'{}' must be true or false", key), key);
  return body[key].get<bool>();
}

// `param` is the request field the ids came from (what an error names).
std::vector<int32_t> token_ids(const json& v, const ApiLimits& limits, const char* what, const char* param) {
  std::vector<int32_t> ids;
  for (const json& x : v) {
    if (!x.is_number_integer()) throw ApiError(400, fmt::format("{} must hold integer token ids", what), param);
    const std::optional<int64_t> id = json_int64(x);
    if (!id || *id < 0 || *id >= limits.vocab)
      throw ApiError(400, fmt::format("token id {} is outside the vocabulary [0, {})", shown(x), limits.vocab), param);
    ids.push_back(static_cast<int32_t>(*id));
  }
  return ids;
}

bool valid_utf8(const std::string& s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    const size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (n == 0 || i + n > s.size()) return false;
    for (size_t j = 1; j < n; ++j)
      if ((static_cast<unsigned char>(s[i + j]) & 0xC0) != 0x80) return false;
    i += n;
  }
  return true;
}

}  // namespace

json error_body(int status, const std::string& message, const std::string& param, const std::string& code) {
  return {{"error",
           {{"message", message},
            {"type", status >= 500 ? "server_error" : "invalid_request_error"},
            {"param", param.empty() ? json(nullptr) : json(param)},
            {"code", code.empty() ? json(status) : json(code)}}}};
}

void check_model(const json& body, const std::vector<std::string>& served) {
  if (!body.is_object() || !present(body, "model")) return;
  if (!body["model"].is_string()) throw ApiError(400, "'model' must be a string", "model");
  const auto& name = body["model"].get_ref<const std::string&>();
  if (std::find(served.begin(), served.end(), name) == served.end())
    throw model_not_found(name, served.empty() ? std::string() : served.front());
}

ApiError model_not_found(const std::string& name, const std::string& served) {
  // OpenAI's status, type and code (which clients match on), and the name that would do.
  return ApiError(404, fmt::format("The model `{}` does not exist; this server serves `{}`", name, served), "model",
                  "model_not_found");
}

std::string token_text(const Tokenizer& tokenizer, int32_t id) {
  if (id == tokenizer.bos_id()) return "<|bos|>";
  if (id == tokenizer.eos_id()) return "<|eos|>";
  if (id == tokenizer.pad_id()) return "<|pad|>";
  std::string piece;
  try {
    piece = tokenizer.decode(std::span<const int32_t>(&id, 1));
  } catch (const Error&) {
    return fmt::format("<|id_{}|>", id);
  }
  if (!piece.empty() && valid_utf8(piece)) return piece;
  std::string out = "bytes:";
  for (unsigned char c : piece) out += fmt::format("\\x{:02x}", c);
  return piece.empty() ? fmt::format("<|id_{}|>", id) : out;
}

CompletionRequest parse_completion_request(const json& body, const Tokenizer& tokenizer, const ApiLimits& limits,
                                           uint64_t default_seed) {
  CompletionRequest r;
  r.ignored_fields = unknown_fields(body, kCompletionFields);
  if (present(body, "model") && !body["model"].is_string()) throw ApiError(400, "'model' must be a string", "model");
  // OpenAI's bounds: n up to 128, best_of up to 20.
  r.n = get_int(body, "n", 1, 1, 128);
  r.best_of = get_int(body, "best_of", r.n, 1, 20);
  if (r.best_of < r.n)
    throw ApiError(400, fmt::format("'best_of' ({}) must be at least 'n' ({})", r.best_of, r.n), "best_of");
  // The group field: best_of when it asks for more sequences than n, else n.
  const char* group = r.best_of > r.n ? "best_of" : "n";
  if (limits.slots > 0 && r.best_of > limits.slots)
    throw ApiError(400,
                   fmt::format("'{}' is {}: a prompt's sequences run at once, one decode slot each, and this server "
                               "has {} (--slots)",
                               group, r.best_of, limits.slots),
                   group);
  if (present(body, "suffix") && !(body["suffix"].is_string() && body["suffix"].get_ref<const std::string&>().empty()))
    throw ApiError(400, "'suffix' is not supported", "suffix");
  if (present(body, "user") && !body["user"].is_string()) throw ApiError(400, "'user' must be a string", "user");
  r.stream = get_bool(body, "stream", false);
  if (present(body, "stream_options")) {
    const json& o = body["stream_options"];
    if (!o.is_object()) throw ApiError(400, "'stream_options' must be an object", "stream_options");
    if (!r.stream) throw ApiError(400, "'stream_options' is only allowed with \"stream\": true", "stream_options");
    if (present(o, "include_usage") && !o["include_usage"].is_boolean())
      throw ApiError(400, "'stream_options.include_usage' must be true or false", "stream_options");
    r.include_usage = present(o, "include_usage") && o["include_usage"].get<bool>();
    for (const std::string& key : unknown_fields(o, {"include_usage"})) r.ignored_fields.push_back("stream_options." + key);
  }
  if (r.stream && r.best_of > r.n)  // the best are known only at the end (OpenAI refuses it too)
    throw ApiError(400, "'best_of' greater than 'n' is not supported with \"stream\": true", "best_of");

  // max_completion_tokens: the newer name of max_tokens (OpenAI's chat API; clients send it
  // for completions too). Both given, they must agree.
  const int64_t max_tokens = get_int(body, "max_tokens", get_int(body, "max_completion_tokens", 16, 0, limits.context),
                                     0, limits.context);
  if (present(body, "max_tokens") && present(body, "max_completion_tokens") &&
      get_int(body, "max_completion_tokens", 0, 0, limits.context) != max_tokens)
    throw ApiError(400, "'max_tokens' and 'max_completion_tokens' differ; give one", "max_completion_tokens");
  SamplingParams sampling;
  sampling.temperature = get_number(body, "temperature", 1.0, 0, 1e6);
  sampling.top_p = get_number(body, "top_p", 1.0, 0, 1);
  if (sampling.top_p == 0) throw ApiError(400, "'top_p' must be in (0, 1]", "top_p");
  sampling.top_k = get_int(body, "top_k", 0, -1, int64_t(1) << 31);
  if (sampling.top_k < 0) sampling.top_k = 0;  // -1 = off (vLLM's convention)
  sampling.min_p = get_number(body, "min_p", 0.0, 0, 1);
  sampling.repetition_penalty = get_number(body, "repetition_penalty", 1.0, 1e-6, 1e6);
  sampling.presence_penalty = get_number(body, "presence_penalty", 0, -2, 2);
  sampling.frequency_penalty = get_number(body, "frequency_penalty", 0, -2, 2);
  sampling.logit_bias = parse_logit_bias(body, limits.vocab);
  r.echo = get_bool(body, "echo", false);
  if (present(body, "logprobs")) r.logprobs = get_int(body, "logprobs", 0, 0, limits.max_logprobs);
  const uint64_t seed = present(body, "seed") ? static_cast<uint64_t>(get_int(body, "seed", 0, INT64_MIN, INT64_MAX))
                                             : default_seed;
  const bool ignore_eos = get_bool(body, "ignore_eos", false);
  std::vector<std::string> stop;
  if (present(body, "stop")) {
    const json& s = body["stop"];
    if (s.is_string()) stop.push_back(s.get<std::string>());
    else if (s.is_array() && s.size() <= 16 && std::all_of(s.begin(), s.end(), [](const json& x) { return x.is_string(); }))
      for (const json& x : s) stop.push_back(x.get<std::string>());
    else throw ApiError(400, "'stop' must be a string or a list of at most 16 strings", "stop");
  }

  // Prompts: a string, a list of strings, a list of ids, or a list of lists of ids.
  if (!body.contains("prompt")) throw ApiError(400, "missing field 'prompt'", "prompt");
  const json& p = body["prompt"];
  std::vector<std::vector<int32_t>> prompts;
  auto add_text = [&](const std::string& text) {
    std::vector<int32_t> ids;
    if (limits.add_bos) ids.push_back(tokenizer.bos_id());
    for (int32_t id : tokenizer.encode(text)) ids.push_back(id);
    prompts.push_back(std::move(ids));
    r.prompt_texts.push_back(text);
  };
  auto add_ids = [&](std::vector<int32_t> ids) {
    r.prompt_texts.push_back(tokenizer.decode(ids));
    prompts.push_back(std::move(ids));
  };
  const char* shape = "'prompt' must be a string, a list of strings, a list of token ids or a list of lists of ids";
  if (p.is_string()) {
    add_text(p.get<std::string>());
  } else if (p.is_array() && !p.empty()) {
    if (static_cast<int64_t>(p.size()) > std::max(limits.max_prompts, limits.context))
      throw ApiError(400, "'prompt' is too long", "prompt");
    if (std::all_of(p.begin(), p.end(), [](const json& x) { return x.is_string(); })) {
      for (const json& x : p) add_text(x.get<std::string>());
    } else if (std::all_of(p.begin(), p.end(), [](const json& x) { return x.is_number_integer(); })) {
      add_ids(token_ids(p, limits, "'prompt'", "prompt"));
    } else if (std::all_of(p.begin(), p.end(), [](const json& x) { return x.is_array() && !x.empty(); })) {
      for (const json& x : p) add_ids(token_ids(x, limits, "each prompt", "prompt"));
    } else {
      throw ApiError(400, shape, "prompt");
    }
  } else {
    throw ApiError(400, shape, "prompt");
  }
  if (static_cast<int64_t>(prompts.size()) > limits.max_prompts)
    throw ApiError(400, fmt::format("{} prompts in one request; at most {}", prompts.size(), limits.max_prompts),
                   "prompt");
  if (limits.max_sequences > 0 && static_cast<int64_t>(prompts.size()) * r.best_of > limits.max_sequences)
    throw ApiError(400,
                   fmt::format("{} prompts x '{}' {} = {} sequences; this server queues at most {} (--max-pending)",
                               prompts.size(), group, r.best_of, static_cast<int64_t>(prompts.size()) * r.best_of,
                               limits.max_sequences),
                   group);
  for (size_t i = 0; i < prompts.size(); ++i) {
    const auto n = static_cast<int64_t>(prompts[i].size());
    if (n == 0) throw ApiError(400, fmt::format("prompt {} is empty", i), "prompt");
    if (n + max_tokens > limits.context)
      throw ApiError(400,
                     fmt::format("this model's maximum context length is {} tokens; prompt {} has {} tokens and "
                                 "max_tokens is {}",
                                 limits.context, i, n, max_tokens),
                     "prompt");
    GenerationRequest g;
    g.prompt = std::move(prompts[i]);
    g.max_tokens = max_tokens;
    g.sampling = sampling;
    g.stop = stop;
    g.stop_at_eos = !ignore_eos;
    // best_of ranks by the logprobs, so they are computed even when not shown.
    g.logprobs = r.logprobs.has_value() || r.best_of > r.n;
    g.prompt_logprobs = r.logprobs.has_value() && r.echo;
    g.top_logprobs = r.logprobs.value_or(0);
    for (int64_t c = 0; c < r.best_of; ++c) {
      g.seed = seed + static_cast<uint64_t>(r.sequences.size());
      g.shares_prefill = c > 0;
      r.sequences.push_back(g);
    }
  }
  return r;
}

json completion_response(const CompletionRequest& request, const std::vector<GenerationResult>& results,
                         const Tokenizer& tokenizer, const std::string& model, const std::string& id,
                         int64_t created) {
  json choices = json::array();
  int64_t completion_tokens = 0;  // of every sequence generated, those best_of left out too
  for (const GenerationResult& g : results) completion_tokens += static_cast<int64_t>(g.tokens.size());
  const std::vector<size_t> chosen = answer_sequences(request, results);
  for (size_t i = 0; i < chosen.size(); ++i) {
    const GenerationResult& g = results[chosen[i]];
    const GenerationRequest& q = request.sequences[chosen[i]];
    const std::string& prompt_text = request.prompt_texts[chosen[i] / static_cast<size_t>(request.best_of)];
    json choice = {{"index", i},
                   {"text", (request.echo ? prompt_text : std::string()) + g.text},
                   {"finish_reason", g.finish_reason},
                   {"logprobs", nullptr}};
    if (request.logprobs) {
      json lp = legacy_logprobs();
      int64_t offset = 0;
      if (request.echo)
        for (size_t t = 0; t < q.prompt.size(); ++t)
          append_logprob(lp, tokenizer, q.prompt[t], t < g.prompt_logprobs.size() ? &g.prompt_logprobs[t] : nullptr,
                         offset);
      for (size_t t = 0; t < g.tokens.size(); ++t)
        append_logprob(lp, tokenizer, g.tokens[t], t < g.logprobs.size() ? &g.logprobs[t] : nullptr, offset);
      // The ending EOS: listed, as OpenAI's servers do; no text.
      if (g.eos_logprob) append_logprob(lp, tokenizer, g.eos_logprob->token, &*g.eos_logprob, offset);
      choice["logprobs"] = std::move(lp);
    }
    choices.push_back(std::move(choice));
  }
  return {{"id", id},
          {"object", "text_completion"},
          {"created", created},
          {"model", model},
          {"choices", choices},
          {"usage", usage_json(prompt_tokens(request.sequences), completion_tokens)}};
}

json legacy_logprobs() {
  return {{"tokens", json::array()}, {"token_logprobs", json::array()}, {"top_logprobs", json::array()},
          {"text_offset", json::array()}};
}

void append_logprob(json& logprobs, const Tokenizer& tokenizer, int32_t token, const TokenLogprob* logprob,
                    int64_t& offset) {
  logprobs["tokens"].push_back(token_text(tokenizer, token));
  logprobs["text_offset"].push_back(offset);
  offset += static_cast<int64_t>(tokenizer.decode(std::span<const int32_t>(&token, 1)).size());
  if (logprob == nullptr || std::isnan(logprob->logprob)) {
    logprobs["token_logprobs"].push_back(nullptr);
    logprobs["top_logprobs"].push_back(nullptr);
    return;
  }
  logprobs["token_logprobs"].push_back(logprob->logprob);
  json top = json::object();
  for (const auto& [alt, value] : logprob->top) top[token_text(tokenizer, alt)] = value;
  logprobs["top_logprobs"].push_back(std::move(top));
}

json usage_json(int64_t prompt_tokens, int64_t completion_tokens) {
  return {{"prompt_tokens", prompt_tokens},
          {"completion_tokens", completion_tokens},
          {"total_tokens", prompt_tokens + completion_tokens}};
}

std::string tokenize_response(const json& body, const Tokenizer& tokenizer, const ApiLimits& limits) {
  only_fields(body, {"model", "prompt", "add_special_tokens"});
  if (!body.contains("prompt") || !body["prompt"].is_string())
    throw ApiError(400, "'prompt' must be a string", "prompt");
  const bool special = get_bool(body, "add_special_tokens", true);
  const auto& text = body["prompt"].get_ref<const std::string&>();
  if (static_cast<int64_t>(text.size()) > limits.max_tokenize_bytes)
    throw ApiError(413,
                   fmt::format("'prompt' is {} bytes; /tokenize takes at most {} bytes of text a request", text.size(),
                               limits.max_tokenize_bytes),
                   "prompt");
  std::vector<int32_t> ids = tokenizer.encode(text);
  if (special) ids.insert(ids.begin(), tokenizer.bos_id());
  return fmt::format(R"({{"tokens":[{}],"count":{},"max_model_len":{}}})", fmt::join(ids, ","), ids.size(),
                     limits.context);
}

ApiError too_many_detokenize_ids(const ApiLimits& limits) {
  return ApiError(413, fmt::format("'tokens' holds more than {} ids, the most /detokenize takes a request",
                                   limits.max_detokenize_ids),
                  "tokens");
}

json detokenize_response(const json& body, const Tokenizer& tokenizer, const ApiLimits& limits) {
  only_fields(body, {"model", "tokens"});
  if (!body.contains("tokens") || !body["tokens"].is_array())
    throw ApiError(400, "'tokens' must be a list of token ids", "tokens");
  if (static_cast<int64_t>(body["tokens"].size()) > limits.max_detokenize_ids) throw too_many_detokenize_ids(limits);
  ApiLimits l = limits;
  l.vocab = std::min<int64_t>(limits.vocab, tokenizer.vocab_size());
  return {{"prompt", tokenizer.decode(token_ids(body["tokens"], l, "'tokens'", "tokens"))}};
}

}  // namespace kiln::serve

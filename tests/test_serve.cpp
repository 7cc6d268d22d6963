// `kiln serve` over real HTTP on 127.0.0.1 (an ephemeral port): lm-evaluation-harness's
// loglikelihood and generation requests, tokenize/detokenize, bad requests answered 4xx
// with a message (never a crash), concurrent requests batched with the same answers as
// alone, and the CLI server started and stopped by signal. Request counts and timeouts are
// bounded.
#include "full_forward.h"
#include "serve_fixture.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <thread>

namespace kiln {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

class ServeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    serve::ServeOptions s;
    s.threads = 6;
    s.max_body_bytes = 64 * 1024;
    s.limits.max_prompts = 16;
    served_ = std::make_unique<test::ServedModel>(tokenizer_, s);
    model_ = served_->model.get();
    server_ = served_->server.get();
    port_ = served_->port;
  }
  void TearDown() override { served_.reset(); }

  httplib::Client client() const {
    httplib::Client c("127.0.0.1", port_);
    c.set_connection_timeout(5, 0);
    c.set_read_timeout(30, 0);
    return c;
  }
  // POST, expecting `status`; returns the parsed JSON body.
  json post(const std::string& path, const std::string& body, int status = 200) const {
    auto res = client().Post(path.c_str(), body, "application/json");
    EXPECT_TRUE(res) << "no response to " << body;
    if (!res) return json();
    EXPECT_EQ(res->status, status) << body << " -> " << res->body;
    json j = json::parse(res->body, nullptr, false);
    EXPECT_FALSE(j.is_discarded()) << "not JSON: " << res->body;
    if (status >= 400) {
      EXPECT_TRUE(j.contains("error") && j["error"]["message"].is_string() && !j["error"]["message"].empty())
          << res->body;
    }
    return j;
  }
  // Log-probabilities of every token of `ids` given those before it, by the full forward.
  std::vector<double> reference_logprobs(const std::vector<int32_t>& ids) {
    const std::vector<float> logits = test::full_forward_logits(*model_, ids, 0, static_cast<int64_t>(ids.size()));
    std::vector<double> out{NAN}, lp;
    for (size_t i = 1; i < ids.size(); ++i) {
      log_softmax(std::span<const float>(logits.data() + (i - 1) * 259, 259), lp);
      out.push_back(lp[static_cast<size_t>(ids[i])]);
    }
    return out;
  }

  ByteTokenizer tokenizer_;
  std::unique_ptr<test::ServedModel> served_;
  Model* model_ = nullptr;
  serve::CompletionServer* server_ = nullptr;
  int port_ = 0;
};

std::vector<int32_t> bytes_of(const std::string& s, bool bos = true) {
  std::vector<int32_t> ids;
  if (bos) ids.push_back(256);
  for (unsigned char c : s) ids.push_back(c);
  return ids;
}

// What lm-eval's local-completions does with a loglikelihood answer (parse_logprobs).
std::pair<double, bool> lm_eval_parse(const json& choice, size_t ctxlen, bool drop_last) {
  const json& lp = choice["logprobs"];
  const size_t end = lp["token_logprobs"].size() - (drop_last ? 1 : 0);
  double sum = 0;
  bool greedy = true;
  for (size_t i = ctxlen; i < end; ++i) {
    const double tok = lp["token_logprobs"][i];
    sum += tok;
    double best = -INFINITY;
    for (const auto& [k, v] : lp["top_logprobs"][i].items()) best = std::max(best, v.get<double>());
    greedy = greedy && tok == best;
  }
  return {sum, greedy};
}

TEST_F(ServeTest, LoglikelihoodRequestsAsLmEvalSendsThem) {
  const std::vector<int32_t> context = bytes_of("The cat"), full = bytes_of("The cat sat");
  const std::vector<double> want = reference_logprobs(full);
  for (int max_tokens : {0, 1}) {
    json body = {{"model", "kiln"}, {"prompt", json::array({full, context})}, {"max_tokens", max_tokens},
                 {"temperature", 0}, {"logprobs", 1}, {"echo", true}, {"seed", 1234}};
    const json r = post("/v1/completions", body.dump());
    ASSERT_EQ(r["choices"].size(), 2u);
    const json& c = r["choices"][0];
    ASSERT_EQ(c["logprobs"]["token_logprobs"].size(), full.size() + max_tokens);
    EXPECT_TRUE(c["logprobs"]["token_logprobs"][0].is_null());
    EXPECT_TRUE(c["logprobs"]["top_logprobs"][0].is_null());
    EXPECT_EQ(c["logprobs"]["tokens"][0], "<|bos|>");
    for (size_t i = 1; i < full.size(); ++i)
      EXPECT_NEAR(c["logprobs"]["token_logprobs"][i].get<double>(), want[i], 1e-4) << i;
    const auto [sum, greedy] = lm_eval_parse(c, context.size(), max_tokens == 1);
    double expected = 0;
    bool expected_greedy = true;
    for (size_t i = context.size(); i < full.size(); ++i) {
      expected += want[i];
      const auto& top = c["logprobs"]["top_logprobs"][i];
      expected_greedy = expected_greedy && top.begin().value().get<double>() == c["logprobs"]["token_logprobs"][i];
    }
    EXPECT_NEAR(sum, expected, 1e-4);
    EXPECT_EQ(greedy, expected_greedy);
    EXPECT_EQ(c["text"].get<std::string>().substr(0, 11), "The cat sat");
    EXPECT_EQ(r["usage"]["prompt_tokens"], full.size() + context.size());
  }
}

// Byte-level, with its EOS moved to a chosen id: the token the model's greedy choice will
// be, so that a generation ends by EOS at a known step.
class MovableEosTokenizer final : public Tokenizer {
 public:
  std::vector<int32_t> encode(std::string_view text) const override { return bytes_.encode(text); }
  std::string decode(std::span<const int32_t> ids) const override { return bytes_.decode(ids); }
  int32_t vocab_size() const override { return bytes_.vocab_size(); }
  int32_t bos_id() const override { return bytes_.bos_id(); }
  int32_t eos_id() const override { return eos; }
  int32_t pad_id() const override { return bytes_.pad_id(); }
  std::string name() const override { return "movable-eos"; }
  std::atomic<int32_t> eos{257};

 private:
  ByteTokenizer bytes_;
};

// A generation that ends by EOS still lists the EOS's log-probability after the generated
// tokens (none here), as OpenAI-style servers do, without its text: lm-eval's
// local-completions takes the last entry of an echoed prompt's list for the generated token
// and drops it, so without the EOS entry it dropped the continuation's last token instead.
TEST(ServeEos, AnEndingEosIsListedWithItsLogprobAfterTheEchoedPrompt) {
  MovableEosTokenizer tokenizer;
  test::ServedModel served(tokenizer, serve::ServeOptions{});
  const std::vector<int32_t> full = bytes_of("The cat sat");
  const std::vector<float> last = test::full_forward_last(*served.model, full);
  const auto greedy = static_cast<int32_t>(std::max_element(last.begin(), last.begin() + 259) - last.begin());
  std::vector<double> lp;
  log_softmax(std::span<const float>(last.data(), 259), lp);
  tokenizer.eos = greedy;  // the model's next token is now its EOS
  httplib::Client c("127.0.0.1", served.port);
  c.set_read_timeout(30, 0);
  const json body = {{"model", "kiln"}, {"prompt", json::array({full})}, {"max_tokens", 1}, {"temperature", 0},
                     {"logprobs", 1},   {"echo", true}};
  const auto res = c.Post("/v1/completions", body.dump(), "application/json");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  const json choice = json::parse(res->body)["choices"][0];
  EXPECT_EQ(choice["finish_reason"], "stop");
  EXPECT_EQ(choice["text"], "The cat sat");  // the EOS adds no text
  const json& token_logprobs = choice["logprobs"]["token_logprobs"];
  ASSERT_EQ(token_logprobs.size(), full.size() + 1);
  EXPECT_NEAR(token_logprobs.back().get<double>(), lp[static_cast<size_t>(greedy)], 1e-4);
  EXPECT_EQ(choice["logprobs"]["top_logprobs"].back().begin().value().get<double>(), token_logprobs.back());
  // lm-eval's parse of it: every continuation token of " sat" counted.
  const size_t context = bytes_of("The cat").size();
  double continuation = 0;
  for (size_t i = context; i < full.size(); ++i) continuation += token_logprobs[i].get<double>();
  EXPECT_DOUBLE_EQ(lm_eval_parse(choice, context, true).first, continuation);
}

// A token as the logprobs list shows it, back to its id (byte-level).
int32_t id_of(const std::string& shown) {
  if (shown.rfind("bytes:\\x", 0) == 0) return std::stoi(shown.substr(8, 2), nullptr, 16);
  EXPECT_EQ(shown.size(), 1u) << shown;
  return static_cast<unsigned char>(shown[0]);
}

TEST_F(ServeTest, GenerationWithStopsAndTokenizeEndpoints) {
  const std::vector<int32_t> prompt = bytes_of("Hello");
  json body = {{"prompt", prompt}, {"max_tokens", 12}, {"temperature", 0}, {"logprobs", 0}, {"ignore_eos", true}};
  const json r = post("/v1/completions", body.dump());
  std::vector<int32_t> served;
  for (const auto& t : r["choices"][0]["logprobs"]["tokens"]) served.push_back(id_of(t.get<std::string>()));
  // The same greedy continuation as a generator alone (own cache, same weights).
  Decoder decoder(*model_, DecoderOptions{});
  Generator alone(decoder, tokenizer_);
  GenerationRequest g;
  g.prompt = prompt;
  g.max_tokens = 12;
  g.sampling.temperature = 0;
  g.stop_at_eos = false;
  const GenerationResult want = alone.run({g})[0];
  EXPECT_EQ(served, want.tokens);
  EXPECT_EQ(r["choices"][0]["finish_reason"], "length");
  // A stop string (the first ASCII letter or digit generated) ends generation at that token.
  const auto at = std::find_if(want.tokens.begin(), want.tokens.end(), [](int32_t t) { return t < 128 && std::isalnum(t); });
  if (at != want.tokens.end()) {
    body["stop"] = {std::string(1, static_cast<char>(*at)), "never-seen"};
    const json s = post("/v1/completions", body.dump());
    EXPECT_EQ(s["choices"][0]["finish_reason"], "stop");
    EXPECT_EQ(s["usage"]["completion_tokens"], at - want.tokens.begin() + 1);
    const std::string expected(want.text.begin(), want.text.begin() + (at - want.tokens.begin()));
    // The server sends invalid UTF-8 as U+FFFD; compare in that form.
    EXPECT_EQ(s["choices"][0]["text"], json::parse(json(expected).dump(-1, ' ', false, json::error_handler_t::replace)));
  }
  const std::string text = "naïve 🚀";
  const json t = post("/tokenize", json{{"prompt", text}}.dump());
  EXPECT_EQ(t["tokens"].get<std::vector<int32_t>>(), bytes_of(text));
  EXPECT_EQ(t["max_model_len"], 64);
  const json d = post("/detokenize", json{{"tokens", bytes_of(text)}}.dump());
  EXPECT_EQ(d["prompt"], text);
  EXPECT_EQ(post("/tokenize", json{{"prompt", "ab"}, {"add_special_tokens", false}}.dump())["count"], 2);
}

// JSON integers of 2^63 and above wrapped to negatives (nlohmann keeps them unsigned and
// get<int64_t>() wraps): top_k 2^64 - 1 was read as -1 (off) and served, a seed of 2^63 as
// -2^63, an id of 2^64 - 1 refused as "token id -1" (issue 38). Each is a 400 naming the
// field and showing the number as sent; numbers JSON parses as doubles (2^64, -2^63 - 1,
// 1e300) are not integers.
TEST_F(ServeTest, IntegersBeyondInt64AreRefusedNamingTheField) {
  struct Case {
    std::string path, body, param, message;
  };
  const std::vector<Case> cases = {
      {"/v1/completions", R"({"prompt": "x", "top_k": 18446744073709551615})", "top_k",
       "'top_k' must be in [-1, 2147483648], got 18446744073709551615"},
      {"/v1/completions", R"({"prompt": "x", "top_k": 9223372036854775808})", "top_k", "got 9223372036854775808"},
      {"/v1/completions", R"({"prompt": "x", "seed": 9223372036854775808})", "seed",
       "'seed' must be in [-9223372036854775808, 9223372036854775807], got 9223372036854775808"},
      {"/v1/completions", R"({"prompt": "x", "seed": 18446744073709551616})", "seed", "'seed' must be an integer"},
      {"/v1/completions", R"({"prompt": "x", "seed": -9223372036854775809})", "seed", "'seed' must be an integer"},
      {"/v1/completions", R"({"prompt": "x", "max_tokens": 18446744073709551615})", "max_tokens",
       "got 18446744073709551615"},
      {"/v1/completions", R"({"prompt": "x", "logprobs": 18446744073709551615})", "logprobs",
       "got 18446744073709551615"},
      {"/v1/completions", R"({"prompt": "x", "temperature": 1e300})", "temperature", "'temperature' must be in"},
      {"/v1/completions", R"({"prompt": [256, 18446744073709551615]})", "prompt",
       "token id 18446744073709551615 is outside the vocabulary [0, 259)"},
      {"/v1/completions", R"({"prompt": [[256, 9223372036854775808]]})", "prompt",
       "token id 9223372036854775808 is outside"},
      {"/detokenize", R"({"tokens": [18446744073709551615]})", "tokens", "token id 18446744073709551615 is outside"},
  };
  for (const Case& c : cases) {
    const json error = post(c.path, c.body, 400)["error"];
    EXPECT_EQ(error["param"], c.param) << c.body;
    EXPECT_NE(error["message"].get<std::string>().find(c.message), std::string::npos) << c.body << " -> " << error;
  }
  EXPECT_EQ(post("/v1/completions", R"({"prompt": "ok", "max_tokens": 2, "seed": 9223372036854775807})")["choices"].size(),
            1u);
}

// /tokenize and /detokenize were bounded by the body limit alone, and held about 44 times
// the body (a 16 MiB text became 16M ids as a JSON array, about 700 MB; 8M ids to
// detokenize 350 MB; issue 38). Text bytes and ids per request are bounded now (413 naming
// the field and the bound), the ids counted while the body is parsed.
TEST(ServeTokenize, TextAndIdsPerRequestAreBoundedNamingTheField) {
  ByteTokenizer tokenizer;
  serve::ServeOptions options;
  options.limits.max_tokenize_bytes = 1000;
  options.limits.max_detokenize_ids = 100;
  test::ServedModel served(tokenizer, options);
  httplib::Client c = served.client();
  const auto post = [&](const char* path, const json& body) {
    auto res = c.Post(path, body.dump(), "application/json");
    EXPECT_TRUE(res) << path;
    return res ? std::make_pair(res->status, json::parse(res->body)) : std::make_pair(0, json());
  };
  auto [status, answer] = post("/tokenize", {{"prompt", std::string(1000, 'a')}});
  EXPECT_EQ(status, 200);
  EXPECT_EQ(answer["count"], 1001);
  EXPECT_EQ(answer["tokens"], json(bytes_of(std::string(1000, 'a'))));
  std::tie(status, answer) = post("/tokenize", {{"prompt", std::string(1001, 'a')}});
  EXPECT_EQ(status, 413);
  EXPECT_EQ(answer["error"]["param"], "prompt");
  EXPECT_EQ(answer["error"]["message"], "'prompt' is 1001 bytes; /tokenize takes at most 1000 bytes of text a request");

  std::tie(status, answer) = post("/detokenize", {{"tokens", std::vector<int32_t>(100, 'a')}});
  EXPECT_EQ(status, 200);
  EXPECT_EQ(answer["prompt"], std::string(100, 'a'));
  for (const size_t ids : {101, 100000}) {  // one past the bound; far past it (refused mid-parse)
    std::tie(status, answer) = post("/detokenize", {{"model", "kiln"}, {"tokens", std::vector<int32_t>(ids, 'a')}});
    EXPECT_EQ(status, 413) << ids;
    EXPECT_EQ(answer["error"]["param"], "tokens");
    EXPECT_EQ(answer["error"]["message"], "'tokens' holds more than 100 ids, the most /detokenize takes a request");
  }
  EXPECT_TRUE(test::health_answers(served.port, 5));
}

TEST_F(ServeTest, BadRequestsGet4xxAndTheServerCarriesOn) {
  const std::vector<std::pair<std::string, int>> bad = {
      {"{\"prompt\": \"x\",", 400},                                   // malformed JSON
      {"[1, 2]", 400},                                                // not an object
      {R"({"prompt": "x", "n": 2, "best_of": 1})", 400},              // best_of below n
      {R"({"max_tokens": 3})", 400},                                  // no prompt
      {R"({"prompt": "x", "max_tokens": "3"})", 400},                 // wrong type
      {R"({"prompt": "x", "max_tokens": -1})", 400},
      {R"({"prompt": "x", "temperature": -0.5})", 400},
      {R"({"prompt": "x", "top_p": 0})", 400},
      {R"({"prompt": "x", "n": 9})", 400},                            // more choices than slots
      {R"({"prompt": "x", "stream": true, "best_of": 2})", 400},     // the best known only at the end
      {R"({"prompt": "x", "logprobs": 99})", 400},
      {R"({"prompt": [], "max_tokens": 1})", 400},
      {R"({"prompt": [[]], "max_tokens": 1})", 400},
      {R"({"prompt": [1, "a"]})", 400},
      {R"({"prompt": [[256, 9999]]})", 400},                          // id outside the vocabulary
      {R"({"prompt": {"a": 1}})", 400},
      {R"({"prompt": "x", "stop": [1]})", 400},
      {R"({"prompt": "x", "presence_penalty": 2.5})", 400},
      {R"({"prompt": "x", "max_tokens": 63})", 400},                  // prompt + max_tokens > 64
      {json{{"prompt", std::string(70, 'a')}, {"max_tokens", 0}}.dump(), 400},
      {json{{"prompt", std::vector<std::string>(17, "a")}}.dump(), 400},  // more prompts than allowed
      {json{{"prompt", std::string(70000, 'a')}}.dump(), 413},        // body over the limit
  };
  for (const auto& [body, status] : bad) post("/v1/completions", body, status);
  post("/tokenize", R"({"text": "x"})", 400);
  // Errors name the field they are about: /detokenize's ids are 'tokens', not 'prompt'.
  EXPECT_EQ(post("/detokenize", R"({"tokens": [1, -1]})", 400)["error"]["param"], "tokens");
  EXPECT_EQ(post("/detokenize", R"({"tokens": [1, "a"]})", 400)["error"]["param"], "tokens");
  EXPECT_EQ(post("/detokenize", R"({"tokens": 3})", 400)["error"]["param"], "tokens");
  EXPECT_EQ(post("/v1/completions", R"({"prompt": [1, 9999]})", 400)["error"]["param"], "prompt");
  auto res = client().Get("/v1/nothing");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 404);
  EXPECT_NE(res->body.find("no route GET /v1/nothing"), std::string::npos) << res->body;
  // A known path with the other method: 405, naming the one it takes (also in Allow).
  res = client().Get("/v1/completions");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 405);
  EXPECT_EQ(res->get_header_value("Allow"), "POST");
  EXPECT_NE(res->body.find("/v1/completions takes POST requests, not GET"), std::string::npos) << res->body;
  post("/health", "{}", 405);
  res = client().Get("/health");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
  EXPECT_EQ(post("/v1/completions", R"({"prompt": "ok", "max_tokens": 2})")["choices"].size(), 1u);
}

TEST_F(ServeTest, ConcurrentRequestsAreBatchedAndAnswerAsAlone) {
  std::vector<std::string> prompts;
  for (int i = 0; i < 12; ++i) prompts.push_back("prompt number " + std::to_string(i) + std::string(i, '!'));
  auto ask = [&](const std::string& p) {
    json body = {{"prompt", p}, {"max_tokens", 10}, {"temperature", 0}, {"logprobs", 0}};
    return post("/v1/completions", body.dump())["choices"][0];
  };
  std::vector<json> sequential;
  for (const auto& p : prompts) sequential.push_back(ask(p));
  std::vector<json> concurrent(prompts.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < prompts.size(); ++i) threads.emplace_back([&, i] { concurrent[i] = ask(prompts[i]); });
  for (auto& t : threads) t.join();
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_EQ(concurrent[i]["text"], sequential[i]["text"]) << prompts[i];
    const auto& a = concurrent[i]["logprobs"]["token_logprobs"];
    const auto& b = sequential[i]["logprobs"]["token_logprobs"];
    ASSERT_EQ(a.size(), b.size());
    for (size_t k = 0; k < a.size(); ++k) EXPECT_NEAR(a[k].get<double>(), b[k].get<double>(), 1e-4);
  }
  EXPECT_GT(server_->worker().max_batch(), 1) << "concurrent requests were not batched";
}

// Requests one after another on one kept-alive connection, two sent in one write
// (pipelined), and a body sent only after "Expect: 100-continue" was answered (as curl
// does for bodies over 1 KiB): each answered in order, on the same connection.
TEST_F(ServeTest, KeepAlivePipeliningAndExpectContinue) {
  test::RawConnection c(port_);
  const std::string completion = R"({"prompt": "ab", "max_tokens": 2, "temperature": 0})";
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(c.send(test::http_request("POST", "/v1/completions", completion)));
    const auto r = c.read_response(30);
    ASSERT_TRUE(r) << "request " << i << " on the kept-alive connection";
    EXPECT_EQ(r->status, 200) << r->body;
    EXPECT_EQ(json::parse(r->body)["usage"]["completion_tokens"], 2);
  }
  ASSERT_TRUE(c.send(test::http_request("POST", "/tokenize", R"({"prompt": "a"})") + test::http_request("GET", "/health") +
                     test::http_request("POST", "/tokenize", R"({"prompt": "bc"})")));
  for (const int count : {2, -1, 3}) {
    const auto r = c.read_response(30);
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 200) << r->body;
    if (count > 0) EXPECT_EQ(json::parse(r->body)["count"], count) << r->body;
  }
  const std::string body = json{{"prompt", std::string(2000, 'x').substr(0, 40)}, {"max_tokens", 1}}.dump() +
                           std::string(2000, ' ');
  ASSERT_TRUE(c.send("POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: " +
                     std::to_string(body.size()) + "\r\n\r\n"));
  EXPECT_FALSE(c.read_response(0.5)) << "answered before the body came";  // read_response skips the 100
  ASSERT_TRUE(c.send(body));
  const auto r = c.read_response(30);
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200) << r->body;
  ASSERT_TRUE(c.send(test::http_request("GET", "/health", "", "Connection: close\r\n")));
  ASSERT_TRUE(c.read_response(10));
  EXPECT_TRUE(c.closed_within(10));
}

// The binary: `kiln serve` on an ephemeral port, one completion, stopped by SIGTERM.
TEST(ServeCli, StartsAnswersAndStopsOnSignal) {
  const std::string root = test::temp_dir("kiln-serve-cli");
  const std::string model = test::save_random_model(test::tiny_config(true, true, false), root + "/model");
  test::ServeProcess serve(model, {"--threads", "1"}, root);
  const int port = serve.wait_for_port();
  if (port > 0) {
    httplib::Client c("127.0.0.1", port);
    c.set_connection_timeout(5, 0);
    c.set_read_timeout(30, 0);
    auto res = c.Post("/v1/completions", R"({"prompt": "Hi", "max_tokens": 3, "temperature": 0})", "application/json");
    ASSERT_TRUE(res);
    EXPECT_EQ(res->status, 200) << res->body;
    EXPECT_EQ(json::parse(res->body)["usage"]["completion_tokens"], 3);
  }
  EXPECT_GT(port, 0) << serve.log();
  // --port 0: the line printed names the port actually bound.
  EXPECT_NE(serve.log().find(fmt::format("on http://127.0.0.1:{} (", port)), std::string::npos) << serve.log();
  EXPECT_EQ(serve.stop(), 0) << serve.log();
  EXPECT_NE(serve.log().find("stopped after"), std::string::npos) << serve.log();
  fs::remove_all(root);
}

}  // namespace
}  // namespace kiln

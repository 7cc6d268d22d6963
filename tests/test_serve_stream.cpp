// Streaming completions ("stream": true) and the request-field policy of `kiln serve`:
// the server-sent-event framing byte by byte, the deltas a stream hands on (never text a
// stop string or a split UTF-8 character could take back), a streamed completion equal to
// the same request unstreamed, fields ignored or refused by name, the model name checked,
// and (the `kiln` binary) a client that leaves mid-stream freeing its slot at once.
#include "serve/completion_stream.h"
#include "serve/sse.h"
#include "serve/token_feed.h"
#include "serve_fixture.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <regex>

namespace kiln {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

TEST(ServeSse, EventsChunksAndHeadsAreTheseBytes) {
  EXPECT_EQ(serve::sse_event(json{{"a", 1}}), "data: {\"a\":1}\n\n");
  EXPECT_EQ(serve::sse_event(json{{"t", std::string("\xe2\x82")}}), "data: {\"t\":\"\xef\xbf\xbd\"}\n\n");
  EXPECT_EQ(serve::kSseDone, "data: [DONE]\n\n");
  EXPECT_EQ(serve::http_chunk("data: [DONE]\n\n"), "e\r\ndata: [DONE]\n\n\r\n");
  EXPECT_EQ(serve::http_chunk(std::string(300, 'x')), "12c\r\n" + std::string(300, 'x') + "\r\n");
  EXPECT_EQ(serve::sse_response_head(true, false),
            "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
            "X-Accel-Buffering: no\r\nTransfer-Encoding: chunked\r\n\r\n");
  EXPECT_EQ(serve::sse_response_head(false, false),
            "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
            "X-Accel-Buffering: no\r\nConnection: close\r\n\r\n");
}

TEST(ServeSse, CompletionChunksAreOpenAIsShape) {
  serve::CompletionRequest request;
  request.prompt_texts = {"Hi", "Yo"};
  ByteTokenizer tokenizer;
  serve::CompletionChunks plain(request, tokenizer, "cmpl-kiln-7", "tiny", 1700000000);
  const std::string stop = "stop";
  EXPECT_EQ(serve::sse_event(plain.chunk(1, "ab", nullptr)),
            "data: {\"choices\":[{\"finish_reason\":null,\"index\":1,\"logprobs\":null,\"text\":\"ab\"}],"
            "\"created\":1700000000,\"id\":\"cmpl-kiln-7\",\"model\":\"tiny\",\"object\":\"text_completion\"}\n\n");
  EXPECT_EQ(serve::http_chunk(serve::sse_event(plain.chunk(0, "", &stop))),
            "a4\r\ndata: {\"choices\":[{\"finish_reason\":\"stop\",\"index\":0,\"logprobs\":null,\"text\":\"\"}],"
            "\"created\":1700000000,\"id\":\"cmpl-kiln-7\",\"model\":\"tiny\",\"object\":\"text_completion\"}\n\n\r\n");
  request.echo = true;
  request.include_usage = true;
  serve::CompletionChunks echoed(request, tokenizer, "c", "m", 1);
  EXPECT_EQ(echoed.chunk(1, "x", nullptr)["choices"][0]["text"], "Yox");  // the prompt, once
  EXPECT_EQ(echoed.chunk(1, "y", nullptr)["choices"][0]["text"], "y");
  EXPECT_TRUE(echoed.chunk(0, "z", nullptr)["usage"].is_null());
  EXPECT_EQ(serve::sse_event(echoed.usage_chunk(3, 4)),
            "data: {\"choices\":[],\"created\":1,\"id\":\"c\",\"model\":\"m\",\"object\":\"text_completion\","
            "\"usage\":{\"completion_tokens\":4,\"prompt_tokens\":3,\"total_tokens\":7}}\n\n");
}

TEST(ServeSse, OnlySettledTextIsHandedOn) {
  const std::vector<std::string> none, stops = {"END", "\n\n"};
  EXPECT_EQ(serve::settled_length("hello", none), 5u);
  EXPECT_EQ(serve::settled_length("caf\xc3", none), 3u);          // half of an é
  EXPECT_EQ(serve::settled_length("caf\xc3\xa9", none), 5u);
  EXPECT_EQ(serve::settled_length("\xe2\x82", none), 0u);         // two of the euro sign's three bytes
  EXPECT_EQ(serve::settled_length("\xf0\x9f\x98\x80", none), 4u);
  EXPECT_EQ(serve::settled_length("the EN", stops), 4u);          // "EN" may become "END"
  EXPECT_EQ(serve::settled_length("the E", stops), 4u);
  EXPECT_EQ(serve::settled_length("line\n", stops), 4u);
  EXPECT_EQ(serve::settled_length("the ENx", stops), 7u);
  EXPECT_EQ(serve::settled_length("", stops), 0u);
}

// The model's side of a feed driven by hand: deltas add up to the final text, held back
// while a stop string may still cut it.
TEST(ServeSse, AFeedsDeltasAddUpToTheFinalText) {
  auto feed = std::make_shared<serve::TokenFeed>();
  std::vector<GenerationRequest> sequences(1);
  sequences[0].stop = {"END"};
  const serve::BatchWorker::Done done = serve::TokenFeed::connect(feed, sequences);
  ASSERT_TRUE(sequences[0].on_token && sequences[0].cancelled);
  GenerationResult partial;
  std::string streamed;
  auto step = [&](const std::string& text) {
    partial.text = text;
    sequences[0].on_token(partial);
    for (const auto& u : feed->wait(std::chrono::milliseconds(100))) streamed += u.text;
  };
  step("ab");
  EXPECT_EQ(streamed, "ab");
  step("abE");
  EXPECT_EQ(streamed, "ab");
  step("abEN");
  EXPECT_EQ(streamed, "ab");
  GenerationResult final;
  final.text = "ab";  // the generator cut "END"
  final.finish_reason = "stop";
  final.tokens = {1, 2, 3, 4, 5};
  done(0, std::move(final));
  const auto last = feed->wait(std::chrono::milliseconds(100));
  ASSERT_EQ(last.size(), 1u);
  EXPECT_EQ(last[0].text, "");
  EXPECT_EQ(last[0].finish_reason, "stop");
  EXPECT_TRUE(feed->finished());
  EXPECT_EQ(feed->completion_tokens(), 5);
  feed->cancel();
  EXPECT_TRUE(sequences[0].cancelled->load());
}

// Logprobs are handed on as drawn, not held back with the text: each update brings those
// of the tokens since the last (the prompt's in the first), the ending EOS's in the last.
TEST(ServeSse, AFeedHandsOnEachLogprobOnce) {
  auto feed = std::make_shared<serve::TokenFeed>();
  std::vector<GenerationRequest> sequences(1);
  sequences[0].stop = {"END"};
  const serve::BatchWorker::Done done = serve::TokenFeed::connect(feed, sequences);
  GenerationResult partial;
  partial.prompt_logprobs = {{7, std::nan(""), {}}, {8, -1.5, {}}};
  partial.logprobs = {{'a', -0.5, {}}};
  partial.text = "a";
  sequences[0].on_token(partial);
  auto updates = feed->wait(std::chrono::milliseconds(100));
  ASSERT_EQ(updates.size(), 1u);
  EXPECT_EQ(updates[0].prompt_logprobs.size(), 2u);
  ASSERT_EQ(updates[0].logprobs.size(), 1u);
  partial.logprobs.push_back({'E', -0.25, {}});  // "E" may start "END": its text waits, its logprob does not
  partial.text = "aE";
  sequences[0].on_token(partial);
  updates = feed->wait(std::chrono::milliseconds(100));
  ASSERT_EQ(updates.size(), 1u);
  EXPECT_EQ(updates[0].text, "");
  EXPECT_TRUE(updates[0].prompt_logprobs.empty());
  ASSERT_EQ(updates[0].logprobs.size(), 1u);
  EXPECT_EQ(updates[0].logprobs[0].token, 'E');
  GenerationResult final = partial;
  final.logprobs.push_back({'x', -2.0, {}});
  final.text = "aEx";
  final.eos_logprob = TokenLogprob{2, -0.125, {}};
  final.finish_reason = "stop";
  done(0, std::move(final));
  updates = feed->wait(std::chrono::milliseconds(100));
  ASSERT_EQ(updates.size(), 1u);
  EXPECT_EQ(updates[0].text, "Ex");
  ASSERT_EQ(updates[0].logprobs.size(), 1u);
  EXPECT_EQ(updates[0].logprobs[0].token, 'x');
  ASSERT_TRUE(updates[0].eos_logprob);
  EXPECT_EQ(updates[0].eos_logprob->token, 2);
}

// Unknown fields are ignored and listed; those whose meaning kiln would change are refused
// naming the field; max_completion_tokens is max_tokens' other name.
TEST(ServeFields, IgnoredRefusedAndSynonyms) {
  ByteTokenizer tokenizer;
  serve::ApiLimits limits;
  limits.context = 64;
  limits.vocab = 259;
  limits.slots = 4;
  auto parse = [&](const std::string& body) {
    return serve::parse_completion_request(json::parse(body), tokenizer, limits, 1);
  };
  const serve::CompletionRequest r =
      parse(R"({"prompt": "x", "metadata": {"a": 1}, "service_tier": "auto", "stream": true,
                "stream_options": {"include_usage": true, "continuous_usage_stats": true}})");
  EXPECT_EQ(r.ignored_fields, (std::vector<std::string>{"metadata", "service_tier", "stream_options.continuous_usage_stats"}));
  EXPECT_TRUE(r.stream && r.include_usage);
  EXPECT_EQ(parse(R"({"prompt": "x", "max_completion_tokens": 5})").sequences[0].max_tokens, 5);
  EXPECT_EQ(parse(R"({"prompt": "x", "max_tokens": 5, "max_completion_tokens": 5})").sequences[0].max_tokens, 5);
  EXPECT_EQ(parse(R"({"prompt": "x", "n": 1, "best_of": 1, "logit_bias": {}, "suffix": "", "presence_penalty": 0})")
                .ignored_fields.size(),
            0u);
  const std::vector<std::pair<std::string, std::string>> refused = {
      {R"({"prompt": "x", "n": 5})", "n"},                               // more than the 4 slots
      {R"({"prompt": "x", "n": 2, "best_of": 5})", "best_of"},
      {R"({"prompt": "x", "n": 3, "best_of": 2})", "best_of"},           // below n
      {R"({"prompt": "x", "best_of": 2, "stream": true})", "best_of"},   // the best known only at the end
      {R"({"prompt": "x", "n": 0})", "n"},
      {R"({"prompt": "x", "logit_bias": {"50": 101}})", "logit_bias"},   // past OpenAI's [-100, 100]
      {R"({"prompt": "x", "logit_bias": {"-1": 1}})", "logit_bias"},     // not a token id
      {R"({"prompt": "x", "logit_bias": {"99999": 1}})", "logit_bias"},  // past the vocabulary
      {R"({"prompt": "x", "logit_bias": [1]})", "logit_bias"},
      {R"({"prompt": "x", "suffix": "tail"})", "suffix"},
      {R"({"prompt": "x", "presence_penalty": 2.5})", "presence_penalty"},  // past OpenAI's [-2, 2]
      {R"({"prompt": "x", "frequency_penalty": "1"})", "frequency_penalty"},
      {R"({"prompt": "x", "stream_options": {"include_usage": true}})", "stream_options"},
      {R"({"prompt": "x", "stream": true, "stream_options": {"include_usage": 1}})", "stream_options"},
      {R"({"prompt": "x", "stream": "yes"})", "stream"},
      {R"({"prompt": "x", "max_tokens": 4, "max_completion_tokens": 5})", "max_completion_tokens"},
      {R"({"prompt": "x", "max_completion_tokens": 99})", "max_completion_tokens"},
  };
  for (const auto& [body, field] : refused) {
    try {
      parse(body);
      ADD_FAILURE() << "accepted " << body;
    } catch (const serve::ApiError& e) {
      EXPECT_EQ(e.status, 400) << body;
      EXPECT_EQ(e.param, field) << body << ": " << e.what();
      EXPECT_NE(std::string(e.what()).find(field.substr(0, field.find('_'))), std::string::npos) << e.what();
    }
  }
  const std::vector<std::string> served = {"tiny", "kiln"};
  EXPECT_NO_THROW(serve::check_model(json::parse(R"({"model": "tiny"})"), served));
  EXPECT_NO_THROW(serve::check_model(json::parse(R"({"model": "kiln"})"), served));
  EXPECT_NO_THROW(serve::check_model(json::parse(R"({"prompt": "x"})"), served));
  try {
    serve::check_model(json::parse(R"({"model": "gpt-4"})"), served);
    ADD_FAILURE() << "gpt-4 accepted";
  } catch (const serve::ApiError& e) {
    const json body = serve::error_body(e.status, e.what(), e.param, e.code);
    EXPECT_EQ(body, json::parse(R"({"error": {"message": "The model `gpt-4` does not exist; this server serves `tiny`",
                                    "type": "invalid_request_error", "param": "model", "code": "model_not_found"}})"));
    EXPECT_EQ(e.status, 404);
  }
}

class ServeStreamTest : public ::testing::Test {
 protected:
  void SetUp() override {
    serve::ServeOptions s;
    s.model_name = "tiny";
    served_ = std::make_unique<test::ServedModel>(tokenizer_, s);
  }
  ByteTokenizer tokenizer_;
  std::unique_ptr<test::ServedModel> served_;
};

TEST_F(ServeStreamTest, AStreamedCompletionIsTheUnstreamedOneInPieces) {
  const json request = {{"prompt", {"Once upon", "a time"}}, {"max_tokens", 12}, {"temperature", 0}, {"stop", "ee"}};
  auto res = served_->client().Post("/v1/completions", request.dump(), "application/json");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  const json whole = json::parse(res->body);

  test::RawConnection c(served_->port);
  json streamed = request;
  streamed["stream"] = true;
  streamed["stream_options"] = {{"include_usage", true}};
  for (int round = 0; round < 2; ++round) {  // twice on one connection: the stream leaves it reusable
    ASSERT_TRUE(c.send(test::http_request("POST", "/v1/completions", streamed.dump())));
    std::string head;
    const std::vector<std::string> events = test::read_events(c, &head);
    ASSERT_GE(events.size(), 4u) << head;
    EXPECT_NE(head.find("Content-Type: text/event-stream\r\n"), std::string::npos) << head;
    EXPECT_EQ(events.back(), "[DONE]");
    const json usage = json::parse(events[events.size() - 2]);
    EXPECT_EQ(usage["choices"], json::array());
    EXPECT_EQ(usage["usage"], whole["usage"]);
    std::vector<std::string> text(2);
    std::vector<json> finish(2);
    for (size_t i = 0; i + 2 < events.size(); ++i) {
      const json e = json::parse(events[i]);
      EXPECT_EQ(e["object"], "text_completion");
      EXPECT_EQ(e["model"], "tiny");
      EXPECT_TRUE(e.contains("usage") && e["usage"].is_null());
      const size_t index = e["choices"][0]["index"];
      EXPECT_TRUE(finish[index].is_null()) << "a chunk after choice " << index << "'s last";
      text[index] += e["choices"][0]["text"].get<std::string>();
      finish[index] = e["choices"][0]["finish_reason"];
    }
    for (size_t i = 0; i < 2; ++i) {
      EXPECT_EQ(text[i], whole["choices"][i]["text"]) << i;
      EXPECT_EQ(finish[i], whole["choices"][i]["finish_reason"]) << i;
    }
  }
}

// Streamed with logprobs, each choice's chunks' lists joined are the unstreamed answer's
// (tokens, token_logprobs, top_logprobs, text_offset), with echo's prompt entries first.
TEST_F(ServeStreamTest, StreamedLogprobsJoinToTheUnstreamedOnes) {
  for (const bool echo : {false, true}) {
    const json request = {{"prompt", {"Once upon", "a time"}}, {"max_tokens", 12}, {"temperature", 0},
                          {"stop", "ee"}, {"logprobs", 2}, {"echo", echo}};
    auto res = served_->client().Post("/v1/completions", request.dump(), "application/json");
    ASSERT_TRUE(res);
    ASSERT_EQ(res->status, 200) << res->body;
    const json whole = json::parse(res->body);
    json streamed = request;
    streamed["stream"] = true;
    test::RawConnection c(served_->port);
    ASSERT_TRUE(c.send(test::http_request("POST", "/v1/completions", streamed.dump())));
    const std::vector<std::string> events = test::read_events(c);
    ASSERT_GE(events.size(), 3u);
    std::vector<json> joined(2, serve::legacy_logprobs());
    std::vector<std::string> text(2);
    for (size_t i = 0; i + 1 < events.size(); ++i) {
      const json choice = json::parse(events[i])["choices"][0];
      const size_t index = choice["index"];
      text[index] += choice["text"].get<std::string>();
      for (const char* list : {"tokens", "token_logprobs", "top_logprobs", "text_offset"})
        for (const json& x : choice["logprobs"][list]) joined[index][list].push_back(x);
    }
    for (size_t i = 0; i < 2; ++i) {
      EXPECT_EQ(text[i], whole["choices"][i]["text"]) << i;
      EXPECT_EQ(joined[i], whole["choices"][i]["logprobs"]) << "echo " << echo << ", choice " << i;
      EXPECT_FALSE(joined[i]["tokens"].empty());
    }
  }
}

TEST_F(ServeStreamTest, ModelsByIdAndTheModelField) {
  auto c = served_->client();
  for (const std::string id : {"tiny", "kiln"}) {
    auto res = c.Get(("/v1/models/" + id).c_str());
    ASSERT_TRUE(res);
    EXPECT_EQ(res->status, 200) << res->body;
    EXPECT_EQ(json::parse(res->body)["id"], id);
    EXPECT_EQ(json::parse(res->body)["object"], "model");
  }
  auto res = c.Get("/v1/models/org/other");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 404);
  EXPECT_EQ(json::parse(res->body)["error"]["code"], "model_not_found") << res->body;
  res = c.Post("/v1/completions", R"({"model": "other", "prompt": "x", "stream": true})", "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 404);
  EXPECT_EQ(json::parse(res->body)["error"]["code"], "model_not_found") << res->body;
  res = c.Post("/v1/completions", R"({"model": "tiny", "prompt": "x", "max_tokens": 1, "unknown_thing": 3})",
               "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200) << res->body;
}

// The binary, one slot: a client reads its stream's first event and goes away; the slot
// is free at once (the next request is answered, and the model stopped working on the
// abandoned stream: far fewer steps than its max_tokens).
TEST(ServeStreamProcess, AClientLeavingMidStreamFreesItsSlotAtOnce) {
  const std::string root = test::temp_dir("kiln-serve-stream");
  const std::string model = test::slow_streaming_model(root);
  test::ServeProcess serve(model, {"--threads", "1", "--slots", "1"}, root);
  const int port = serve.wait_for_port(30);
  ASSERT_GT(port, 0) << serve.log();
  constexpr int kAbandoned = 2000;
  {
    test::RawConnection c(port);
    const json body = {{"model", "slow"}, {"prompt", "x"},     {"max_tokens", kAbandoned},
                       {"temperature", 0},         {"ignore_eos", true}, {"stream", true}};
    ASSERT_TRUE(c.send(test::http_request("POST", "/v1/completions", body.dump())));
    ASSERT_TRUE(c.read_through("data: {", 60)) << serve.log();
  }  // closed
  httplib::Client client("127.0.0.1", port);
  client.set_read_timeout(60, 0);
  const auto start = test::Clock::now();
  auto res = client.Post("/v1/completions", R"({"prompt": "y", "max_tokens": 2})", "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200) << res->body;
  const double waited = test::seconds_since(start);
  EXPECT_EQ(serve.stop(), 0) << serve.log();
  std::smatch m;
  const std::string log = serve.log();
  ASSERT_TRUE(std::regex_search(log, m, std::regex("stopped after (\\d+) model steps"))) << log;
  const int steps = std::stoi(m[1]);
  EXPECT_LT(steps, kAbandoned / 2) << "the abandoned stream kept its slot; the next request waited " << waited << " s";
  fmt::print("abandoned stream: {} model steps in all; the next request answered in {:.3f} s\n", steps, waited);
  fs::remove_all(root);
}

// The official `openai` Python client (pinned in scripts/python-requirements.txt) against
// the binary serving a briefly trained model: completions and chat completions with and
// without stream=True and models.retrieve, the greedy text that of `kiln sample` (for chat,
// of the prompt kiln's default template renders; tests/python/openai_client_check.py).
TEST(ServeOpenAIClient, CompletionsChatStreamingAndModelsAgreeWithSample) {
  const std::string root = test::temp_dir("kiln-serve-openai");
  std::string out;
  ASSERT_EQ(test::run_command(test::kiln_binary() + " train " KILN_SOURCE_DIR "/configs/default.toml --set data.path="
                                  KILN_SOURCE_DIR "/data/tinyshakespeare.txt --set train.out_dir=" + root +
                                  " --set model.hidden=64 --set model.layers=2 --set model.heads=4"
                                  " --set model.kv_heads=2 --set model.head_dim=16 --set model.ffn_hidden=128"
                                  " --set model.max_seq_len=128 --set train.micro_batch_tokens=2048"
                                  " --set train.steps=60 --set optim.warmup_steps=10 --set optim.lr=3e-3"
                                  " --set train.eval_every=0 --set train.eval_batches=1 --set train.sample_every=0"
                                  " --set train.sample_tokens=20 --set log.every=50 --set train.threads=2",
                              &out),
            0)
      << out;
  const std::string model = root + "/model";
  ASSERT_EQ(test::run_command(test::kiln_binary() + " sample " + model + " -p 'KING' -n 24 -t 0 --threads 2 2>/dev/null",
                              &out),
            0)
      << out;
  ASSERT_EQ(out.rfind("KING", 0), 0u) << out;
  ASSERT_EQ(out.back(), '\n') << out;
  const std::string expected = out.substr(4, out.size() - 5);
  {
    std::ofstream(root + "/expected.txt", std::ios::binary) << expected;
  }
  // The chat prompt of [{"role": "user", "content": "KING"}] by kiln's default template
  // (serve/chat_template.h), continued by `kiln sample` (the shell keeps the newlines
  // inside single quotes).
  const std::string chat_prompt = "<|user|>\nKING\n<|assistant|>\n";
  ASSERT_EQ(test::run_command(test::kiln_binary() + " sample " + model + " -p '" + chat_prompt +
                                  "' -n 24 -t 0 --threads 2 2>/dev/null",
                              &out),
            0)
      << out;
  ASSERT_EQ(out.rfind(chat_prompt, 0), 0u) << out;
  const std::string chat_expected = out.substr(chat_prompt.size(), out.size() - chat_prompt.size() - 1);
  ASSERT_FALSE(chat_expected.empty()) << "an empty continuation would check nothing";
  {
    std::ofstream(root + "/chat_expected.txt", std::ios::binary) << chat_expected;
  }
  test::ServeProcess serve(model, {"--threads", "1"}, root);
  const int port = serve.wait_for_port(30);
  ASSERT_GT(port, 0) << serve.log();
  const int code = test::run_command(
      fmt::format("{} {}/tests/python/openai_client_check.py {} model KING 24 {}/expected.txt {}/chat_expected.txt",
                  test::kiln_python(), KILN_SOURCE_DIR, port, root, root),
                                     &out);
  EXPECT_EQ(code, 0) << out << "\n" << serve.log();
  fmt::print("{}", out);
  EXPECT_EQ(serve.stop(), 0) << serve.log();
  fs::remove_all(root);
}

}  // namespace
}  // namespace kiln

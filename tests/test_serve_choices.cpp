// n and best_of over loopback: several choices of one prompt from one prefill. Each
// choice is the n = 1 answer with its seed (seed + index), greedy choices are equal,
// streamed choices add up to the unstreamed ones, best_of keeps the highest mean logprob,
// and the prompt is computed once (kiln_prefill_tokens_total).
#include "serve_fixture.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <map>

namespace kiln {
namespace {

using nlohmann::json;

class ServeChoices : public ::testing::Test {
 protected:
  void SetUp() override {
    serve::ServeOptions s;
    s.threads = 4;
    served_ = std::make_unique<test::ServedModel>(tokenizer_, s);
  }

  json post(const std::string& path, const json& body, int status = 200) const {
    auto res = served_->client().Post(path.c_str(), body.dump(), "application/json");
    EXPECT_TRUE(res) << "no response to " << body.dump();
    if (!res) return json();
    EXPECT_EQ(res->status, status) << body.dump() << " -> " << res->body;
    return json::parse(res->body);
  }
  int64_t prefill_tokens() const {
    auto res = served_->client().Get("/metrics");
    const std::string key = "\nkiln_prefill_tokens_total ";
    const size_t at = res ? res->body.find(key) : std::string::npos;
    EXPECT_NE(at, std::string::npos);
    return at == std::string::npos ? -1 : std::stoll(res->body.substr(at + key.size()));
  }
  // The events of a streamed request, parsed, [DONE] left out.
  std::vector<json> stream(const std::string& path, const json& body) const {
    test::RawConnection c(served_->port);
    EXPECT_TRUE(c.send(test::http_request("POST", path, body.dump(), "Content-Type: application/json\r\n")));
    std::vector<json> out;
    for (const std::string& e : test::read_events(c))
      if (e != "[DONE]") out.push_back(json::parse(e));
    return out;
  }

  ByteTokenizer tokenizer_;
  std::unique_ptr<test::ServedModel> served_;
};

const json kSampled = {{"prompt", "The shared prompt"}, {"max_tokens", 10}, {"temperature", 1.0},
                       {"ignore_eos", true}, {"logprobs", 1}};

TEST_F(ServeChoices, EachChoiceIsItsSeedAloneAndThePromptRunsOnce) {
  json two = kSampled;
  two["n"] = 2, two["seed"] = 7;
  const int64_t before = prefill_tokens();
  const json both = post("/v1/completions", two);
  const int64_t prompt = both["usage"]["prompt_tokens"];
  EXPECT_EQ(prefill_tokens() - before, prompt) << "the prompt ran more than once";
  ASSERT_EQ(both["choices"].size(), 2u) << both;
  int64_t generated = 0;
  for (int c = 0; c < 2; ++c) {
    json one = kSampled;
    one["seed"] = 7 + c;
    const json alone = post("/v1/completions", one);
    EXPECT_EQ(both["choices"][c]["index"], c);
    EXPECT_EQ(both["choices"][c]["text"], alone["choices"][0]["text"]) << "choice " << c;
    EXPECT_EQ(both["choices"][c]["logprobs"]["tokens"], alone["choices"][0]["logprobs"]["tokens"]);
    EXPECT_EQ(alone["usage"]["prompt_tokens"], prompt);
    generated += alone["usage"]["completion_tokens"].get<int64_t>();
  }
  EXPECT_NE(both["choices"][0]["text"], both["choices"][1]["text"]) << "the seeds drew the same: nothing checked";
  EXPECT_EQ(both["usage"]["completion_tokens"], generated);  // the prompt counted once, every choice's tokens

  json greedy = kSampled;
  greedy["n"] = 3, greedy["temperature"] = 0;
  const json same = post("/v1/completions", greedy);
  ASSERT_EQ(same["choices"].size(), 3u);
  EXPECT_EQ(same["choices"][1]["text"], same["choices"][0]["text"]);
  EXPECT_EQ(same["choices"][2]["text"], same["choices"][0]["text"]);

  // Chat: the same seeds, the same rule.
  const json messages = json::array({{{"role", "user"}, {"content", "Hello"}}});
  const json chat = post("/v1/chat/completions", {{"messages", messages}, {"n", 2}, {"seed", 3}, {"max_tokens", 8},
                                                  {"temperature", 1.0}, {"ignore_eos", true}});
  ASSERT_EQ(chat["choices"].size(), 2u);
  for (int c = 0; c < 2; ++c) {
    const json alone = post("/v1/chat/completions", {{"messages", messages}, {"seed", 3 + c}, {"max_tokens", 8},
                                                     {"temperature", 1.0}, {"ignore_eos", true}});
    EXPECT_EQ(chat["choices"][c]["message"]["content"], alone["choices"][0]["message"]["content"]) << c;
  }
  // Past the 4 slots (one each, at once): a 400 naming the field.
  json many = kSampled;
  many["n"] = 5;
  EXPECT_EQ(post("/v1/completions", many, 400)["error"]["param"], "n");
}

TEST_F(ServeChoices, StreamedChoicesAddUpToTheUnstreamedOnes) {
  json body = kSampled;
  body.erase("logprobs");
  body["n"] = 2, body["seed"] = 11;
  const json whole = post("/v1/completions", body);
  body["stream"] = true;
  body["stream_options"] = {{"include_usage", true}};
  std::map<int, std::string> text;
  std::map<int, int> finished;
  int usages = 0;
  for (const json& e : stream("/v1/completions", body)) {
    if (!e["usage"].is_null()) {
      ++usages;
      EXPECT_EQ(e["usage"], whole["usage"]);
      continue;
    }
    for (const json& c : e["choices"]) {
      text[c["index"].get<int>()] += c["text"].get<std::string>();
      if (!c["finish_reason"].is_null()) ++finished[c["index"].get<int>()];
    }
  }
  EXPECT_EQ(usages, 1);
  EXPECT_EQ(finished, (std::map<int, int>{{0, 1}, {1, 1}}));
  ASSERT_EQ(text.size(), 2u);
  for (int c = 0; c < 2; ++c) EXPECT_EQ(text[c], whole["choices"][c]["text"]) << "choice " << c;

  // Chat: each choice's role first, then its content.
  const json messages = json::array({{{"role", "user"}, {"content", "Hi"}}});
  json chat = {{"messages", messages}, {"n", 2}, {"seed", 4}, {"max_tokens", 8}, {"temperature", 1.0}};
  const json chat_whole = post("/v1/chat/completions", chat);
  chat["stream"] = true;
  std::map<int, std::string> content, role;
  for (const json& e : stream("/v1/chat/completions", chat))
    for (const json& c : e["choices"]) {
      const int i = c["index"];
      if (c["delta"].contains("role")) role[i] += c["delta"]["role"].get<std::string>();
      if (c["delta"].contains("content")) content[i] += c["delta"]["content"].get<std::string>();
    }
  EXPECT_EQ(role, (std::map<int, std::string>{{0, "assistant"}, {1, "assistant"}}));
  for (int c = 0; c < 2; ++c) EXPECT_EQ(content[c], chat_whole["choices"][c]["message"]["content"]) << c;

  json best = kSampled;
  best.erase("logprobs");
  best["best_of"] = 2, best["stream"] = true;
  EXPECT_EQ(post("/v1/completions", best, 400)["error"]["param"], "best_of");
}

// best_of 3: the three sequences are the n = 1 answers with seeds 9, 10, 11; the answer is
// the one whose tokens' mean logprob (an ending EOS among them) is highest.
TEST_F(ServeChoices, BestOfKeepsTheHighestMeanLogprob) {
  json body = {{"prompt", "Pick"}, {"max_tokens", 6}, {"temperature", 1.0}, {"seed", 9}, {"logprobs", 0}};
  std::vector<json> alone;
  std::vector<double> mean;
  int64_t generated = 0;
  for (int c = 0; c < 3; ++c) {
    json one = body;
    one["seed"] = 9 + c;
    alone.push_back(post("/v1/completions", one)["choices"][0]);
    double sum = 0;
    for (const json& v : alone.back()["logprobs"]["token_logprobs"]) sum += v.get<double>();
    mean.push_back(sum / static_cast<double>(alone.back()["logprobs"]["token_logprobs"].size()));
    generated += static_cast<int64_t>(alone.back()["logprobs"]["tokens"].size()) -
                 (alone.back()["finish_reason"] == "stop" ? 1 : 0);  // an ending EOS is listed, not generated
  }
  std::vector<size_t> order = {0, 1, 2};
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return mean[a] > mean[b]; });
  EXPECT_NE(alone[order[0]]["text"], alone[order[2]]["text"]) << "the seeds drew the same: nothing checked";
  body["best_of"] = 3;
  const json best = post("/v1/completions", body);
  ASSERT_EQ(best["choices"].size(), 1u);
  EXPECT_EQ(best["choices"][0]["text"], alone[order[0]]["text"]);
  EXPECT_EQ(best["usage"]["completion_tokens"], generated);  // all three sequences' tokens
  body["n"] = 2;
  const json two = post("/v1/completions", body);
  ASSERT_EQ(two["choices"].size(), 2u);
  EXPECT_EQ(two["choices"][0]["text"], alone[order[0]]["text"]);
  EXPECT_EQ(two["choices"][1]["text"], alone[order[1]]["text"]);
  EXPECT_EQ(two["choices"][1]["index"], 1);
}

}  // namespace
}  // namespace kiln

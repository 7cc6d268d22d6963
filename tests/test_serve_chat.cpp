// POST /v1/chat/completions: chat templates rendered by minja (kiln's default, and a
// Qwen-style Jinja template read from tokenizer_config.json) to exactly the expected
// prompt, a template that does not parse named by its file, chat's own fields (and
// response_format json_object refused by name), chat chunks byte by byte, and the endpoint
// answering as /v1/completions answers the rendered prompt, unstreamed and streamed.
#include "serve/chat_api.h"
#include "serve/chat_stream.h"
#include "serve/sse.h"
#include "serve_fixture.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

namespace kiln {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// Qwen2.5's template, shortened to its message loop: a default system prompt when the
// first message is not one, each message in <|im_start|>role ... <|im_end|>.
constexpr const char* kQwenStyle =
    "{%- for message in messages %}\n"
    "    {%- if loop.first and message['role'] != 'system' %}\n"
    "        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n";

std::string config_dir_with(const json& config) {
  const std::string dir = test::temp_dir("kiln-chat-template");
  std::ofstream(fs::path(dir) / "tokenizer_config.json") << config.dump();
  return dir;
}

const json kConversation = json::parse(R"([{"role": "user", "content": "Hi"},
                                            {"role": "assistant", "content": "Hello."},
                                            {"role": "user", "content": "Who are you?"}])");

TEST(ChatTemplate, KilnsDefaultIsPlainRoleLines) {
  const serve::ChatTemplate t = serve::ChatTemplate::kiln_default();
  EXPECT_TRUE(t.adds_bos());
  json messages = kConversation;
  messages.insert(messages.begin(), json{{"role", "system"}, {"content", "Be brief."}});
  EXPECT_EQ(t.render(messages),
            "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\nHello.\n<|user|>\nWho are you?\n<|assistant|>\n");
  // A model folder without tokenizer_config.json, or one without chat_template, gets it too.
  EXPECT_EQ(serve::ChatTemplate::for_model("").origin(), t.origin());
  const std::string dir = config_dir_with({{"eos_token", "<|eos|>"}});
  EXPECT_EQ(serve::ChatTemplate::for_model(dir).origin(), t.origin());
  fs::remove_all(dir);
}

TEST(ChatTemplate, AQwenStyleTemplateFromTokenizerConfigRendersExactly) {
  const std::string dir = config_dir_with({{"chat_template", kQwenStyle}, {"eos_token", "<|im_end|>"}});
  const serve::ChatTemplate t = serve::ChatTemplate::for_model(dir);
  EXPECT_FALSE(t.adds_bos());
  EXPECT_EQ(t.origin(), (fs::path(dir) / "tokenizer_config.json").string());
  EXPECT_EQ(t.render(kConversation),
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nWho are you?<|im_end|>\n"
            "<|im_start|>assistant\n");
  EXPECT_EQ(t.render(json::parse(R"([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}])")),
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n");
  fs::remove_all(dir);
}

// Hugging Face's list of named templates ("default" is used) and bos_token as an object.
TEST(ChatTemplate, NamedTemplatesAndTheBosToken) {
  const std::string dir = config_dir_with(
      {{"chat_template", json::array({{{"name", "tool_use"}, {"template", "tools"}},
                                      {{"name", "default"},
                                       {"template", "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }} "
                                                    "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"}}})},
       {"bos_token", {{"content", "<s>"}, {"lstrip", false}}}});
  EXPECT_EQ(serve::ChatTemplate::for_model(dir).render(json::parse(R"([{"role": "user", "content": "x"}])")),
            "<s>[user] x [assistant]");
  fs::remove_all(dir);
}

TEST(ChatTemplate, ABadTemplateIsOneLineNamingTokenizerConfig) {
  const std::string dir = config_dir_with({{"chat_template", "{% for m in messages %}{{ m.content }}"}});
  try {
    serve::ChatTemplate::for_model(dir);
    ADD_FAILURE() << "a template without endfor parsed";
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    EXPECT_EQ(message.rfind("[serve] ", 0), 0u) << message;
    EXPECT_NE(message.find((fs::path(dir) / "tokenizer_config.json").string() + ": chat_template does not parse"),
              std::string::npos)
        << message;
  }
  fs::remove_all(dir);
  // A template that refuses the messages (raise_exception) is the client's 400, naming them.
  const serve::ChatTemplate strict = serve::ChatTemplate::jinja(
      "{% if messages[0]['role'] != 'user' %}{{ raise_exception('the first message must be the user\\'s') }}"
      "{% endif %}{{ messages[0]['content'] }}",
      "", "", "strict.json");
  try {
    strict.render(json::parse(R"([{"role": "assistant", "content": "x"}])"));
    ADD_FAILURE() << "raise_exception did not raise";
  } catch (const serve::ApiError& e) {
    EXPECT_EQ(e.status, 400);
    EXPECT_EQ(e.param, "messages");
    EXPECT_NE(std::string(e.what()).find("the first message must be the user's"), std::string::npos) << e.what();
  }
}

TEST(ServeChatFields, ChatsOwnFieldsAndRefusals) {
  ByteTokenizer tokenizer;
  serve::ApiLimits limits;
  limits.context = 64;
  limits.vocab = 259;
  const serve::ChatTemplate t = serve::ChatTemplate::kiln_default();
  auto parse = [&](const std::string& body) {
    return serve::parse_chat_request(json::parse(body), tokenizer, t, limits, 1);
  };
  const serve::CompletionRequest r = parse(
      R"({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
          "max_completion_tokens": 3, "logprobs": true, "top_logprobs": 2, "response_format": {"type": "text"},
          "metadata": {}})");
  ASSERT_EQ(r.sequences.size(), 1u);
  std::vector<int32_t> expected = {tokenizer.bos_id()};
  for (int32_t id : tokenizer.encode("<|user|>\nab\n<|assistant|>\n")) expected.push_back(id);
  EXPECT_EQ(r.sequences[0].prompt, expected);
  EXPECT_EQ(r.sequences[0].max_tokens, 3);
  EXPECT_TRUE(r.sequences[0].logprobs);
  EXPECT_EQ(r.sequences[0].top_logprobs, 2);
  EXPECT_EQ(r.ignored_fields, std::vector<std::string>{"metadata"});
  const std::vector<std::pair<std::string, std::string>> refused = {
      {R"({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}})",
       "response_format"},
      {R"({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}})",
       "response_format"},
      {R"({"messages": [{"role": "user", "content": "x"}], "logprobs": 2})", "logprobs"},
      {R"({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})", "top_logprobs"},
      {R"({"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 21})", "top_logprobs"},
      {R"({"messages": [{"role": "user", "content": "x"}], "n": 0})", "n"},
      {R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": 99})", "max_tokens"},
      {R"({"messages": [{"role": "tool", "content": "x"}]})", "messages"},
      {R"({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})", "messages"},
      {R"({"messages": []})", "messages"},
      {R"({"prompt": "x"})", "messages"},
      {R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": 50})", "messages"},  // past the context
  };
  for (const auto& [body, field] : refused) {
    try {
      parse(body);
      ADD_FAILURE() << "accepted " << body;
    } catch (const serve::ApiError& e) {
      EXPECT_EQ(e.status, 400) << body;
      EXPECT_EQ(e.param, field) << body << ": " << e.what();
    }
  }
  try {
    parse(R"({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}})");
  } catch (const serve::ApiError& e) {
    EXPECT_NE(std::string(e.what()).find("'json_object'"), std::string::npos) << e.what();
  }
}

TEST(ServeSse, ChatChunksAreOpenAIsShape) {
  serve::CompletionRequest request;
  request.sequences.resize(1);
  ByteTokenizer tokenizer;
  serve::ChatChunks plain(request, tokenizer, "chatcmpl-kiln-7", "tiny", 1700000000);
  const std::vector<json> opening = plain.opening();
  ASSERT_EQ(opening.size(), 1u);
  EXPECT_EQ(serve::sse_event(opening[0]),
            "data: {\"choices\":[{\"delta\":{\"content\":\"\",\"role\":\"assistant\"},\"finish_reason\":null,"
            "\"index\":0,\"logprobs\":null}],\"created\":1700000000,\"id\":\"chatcmpl-kiln-7\",\"model\":\"tiny\","
            "\"object\":\"chat.completion.chunk\"}\n\n");
  EXPECT_EQ(serve::sse_event(plain.chunk(0, "ab", nullptr)),
            "data: {\"choices\":[{\"delta\":{\"content\":\"ab\"},\"finish_reason\":null,\"index\":0,\"logprobs\":null}],"
            "\"created\":1700000000,\"id\":\"chatcmpl-kiln-7\",\"model\":\"tiny\",\"object\":\"chat.completion.chunk\"}"
            "\n\n");
  const std::string length = "length";
  EXPECT_EQ(serve::http_chunk(serve::sse_event(plain.chunk(0, "", &length))),
            "b1\r\ndata: {\"choices\":[{\"delta\":{},\"finish_reason\":\"length\",\"index\":0,\"logprobs\":null}],"
            "\"created\":1700000000,\"id\":\"chatcmpl-kiln-7\",\"model\":\"tiny\",\"object\":\"chat.completion.chunk\"}"
            "\n\n\r\n");
  request.include_usage = true;
  serve::ChatChunks usage(request, tokenizer, "c", "m", 1);
  EXPECT_TRUE(usage.chunk(0, "z", nullptr)["usage"].is_null());
  EXPECT_EQ(serve::sse_event(usage.usage_chunk(3, 4)),
            "data: {\"choices\":[],\"created\":1,\"id\":\"c\",\"model\":\"m\",\"object\":\"chat.completion.chunk\","
            "\"usage\":{\"completion_tokens\":4,\"prompt_tokens\":3,\"total_tokens\":7}}\n\n");
}

class ServeChatTest : public ::testing::Test {
 protected:
  void SetUp() override {
    serve::ServeOptions s;
    s.model_name = "tiny";
    served_ = std::make_unique<test::ServedModel>(tokenizer_, s);
  }
  ByteTokenizer tokenizer_;
  std::unique_ptr<test::ServedModel> served_;
};

// The chat answer is the completion of the rendered prompt (BOS first, as the default
// template asks), in chat's shape; streamed, the role comes first and the content adds up.
TEST_F(ServeChatTest, AChatIsTheCompletionOfItsRenderedPrompt) {
  const json messages = json::parse(R"([{"role": "system", "content": "S"}, {"role": "user", "content": "Once"}])");
  const std::string rendered = "<|system|>\nS\n<|user|>\nOnce\n<|assistant|>\n";
  auto c = served_->client();
  auto res = c.Post("/v1/completions",
                    json{{"prompt", rendered}, {"max_tokens", 10}, {"temperature", 0}, {"logprobs", 2}}.dump(),
                    "application/json");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  const json completion = json::parse(res->body);
  const json request = {{"model", "tiny"}, {"messages", messages}, {"max_tokens", 10}, {"temperature", 0},
                        {"logprobs", true}, {"top_logprobs", 2}};
  res = c.Post("/v1/chat/completions", request.dump(), "application/json");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  const json chat = json::parse(res->body);
  EXPECT_EQ(chat["object"], "chat.completion");
  EXPECT_EQ(chat["id"].get<std::string>().rfind("chatcmpl-kiln-", 0), 0u) << chat["id"];
  EXPECT_EQ(chat["usage"], completion["usage"]);
  const json& choice = chat["choices"][0];
  EXPECT_EQ(choice["message"], (json{{"role", "assistant"}, {"content", completion["choices"][0]["text"]}}));
  EXPECT_EQ(choice["finish_reason"], completion["choices"][0]["finish_reason"]);
  EXPECT_FALSE(choice.contains("text"));
  const json& content = choice["logprobs"]["content"];
  const json& legacy = completion["choices"][0]["logprobs"];
  ASSERT_EQ(content.size(), chat["usage"]["completion_tokens"].get<size_t>());
  for (size_t i = 0; i < content.size(); ++i) {
    EXPECT_EQ(content[i]["token"], legacy["tokens"][i]);
    EXPECT_EQ(content[i]["logprob"], legacy["token_logprobs"][i]);
    ASSERT_EQ(content[i]["top_logprobs"].size(), 2u);
    for (const json& alt : content[i]["top_logprobs"]) EXPECT_EQ(alt["logprob"], legacy["top_logprobs"][i][alt["token"].get<std::string>()]);
    EXPECT_TRUE(content[i]["bytes"].is_array());
  }

  json streamed = request;  // with its logprobs: the chunks' content lists join to the unstreamed one
  streamed["stream"] = true;
  streamed["stream_options"] = {{"include_usage", true}};
  test::RawConnection raw(served_->port);
  ASSERT_TRUE(raw.send(test::http_request("POST", "/v1/chat/completions", streamed.dump())));
  const std::vector<std::string> events = test::read_events(raw);
  ASSERT_GE(events.size(), 4u);
  EXPECT_EQ(events.back(), "[DONE]");
  EXPECT_EQ(json::parse(events[0])["choices"][0]["delta"], (json{{"role", "assistant"}, {"content", ""}}));
  EXPECT_TRUE(json::parse(events[0])["choices"][0]["logprobs"].is_null());
  EXPECT_EQ(json::parse(events[events.size() - 2])["usage"], chat["usage"]);
  std::string text;
  json finish, joined = json::array();
  for (size_t i = 1; i + 2 < events.size(); ++i) {
    const json e = json::parse(events[i]);
    EXPECT_EQ(e["object"], "chat.completion.chunk");
    EXPECT_FALSE(e["choices"][0]["delta"].contains("role"));
    text += e["choices"][0]["delta"].value("content", "");
    finish = e["choices"][0]["finish_reason"];
    for (const json& t : e["choices"][0]["logprobs"]["content"]) joined.push_back(t);
  }
  EXPECT_EQ(text, choice["message"]["content"]);
  EXPECT_EQ(joined, content);
  EXPECT_EQ(finish, choice["finish_reason"]);

  res = c.Post("/v1/chat/completions",
               R"({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}})",
               "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 400);
  EXPECT_EQ(json::parse(res->body)["error"]["param"], "response_format") << res->body;
}

// The binary: a model folder whose tokenizer_config.json has a template that does not
// parse stops `kiln serve` before it listens, with one line naming the file.
TEST(ServeChatProcess, ABadTemplateStopsServeWithOneLine) {
  const std::string root = test::temp_dir("kiln-serve-chat");
  const std::string model = test::save_random_model(test::tiny_config(true, true, false), root + "/model");
  std::ofstream(fs::path(model) / "tokenizer_config.json") << json{{"chat_template", "{% if x %}unclosed"}}.dump();
  std::string out;
  EXPECT_NE(test::run_command(test::kiln_binary() + " serve " + model + " --port 0 2>&1", &out), 0) << out;
  EXPECT_EQ(out.find("kiln: error: [serve] " + (fs::path(model) / "tokenizer_config.json").string() +
                     ": chat_template does not parse"),
            0u)
      << out;
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1) << out;
  fs::remove_all(root);
}

}  // namespace
}  // namespace kiln

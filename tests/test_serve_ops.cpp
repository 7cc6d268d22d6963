// The operations side of `kiln serve`: GET /metrics in Prometheus' text format (its
// counters checked after known requests), the access log line, and graceful shutdown on
// SIGTERM (a stream in progress completes, or is cut at --shutdown-grace; new connections
// are refused; the process exits 0).
#include "serve/access_log.h"
#include "serve/serve_metrics.h"
#include "serve_fixture.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <chrono>
#include <csignal>
#include <filesystem>
#include <map>
#include <regex>
#include <sstream>
#include <thread>

namespace kiln {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// A text exposition's samples: "name{labels}" as written -> value. Fails the test on a
// line that is neither a comment nor `series value`.
std::map<std::string, double> parse_exposition(const std::string& text) {
  std::map<std::string, double> samples;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    const size_t space = line.rfind(' ');
    if (space == std::string::npos) {
      ADD_FAILURE() << "not a sample: " << line;
      continue;
    }
    const std::string value = line.substr(space + 1);
    samples[line.substr(0, space)] = value == "+Inf" ? INFINITY : std::stod(value);
  }
  return samples;
}

TEST(ServeMetricsText, HistogramsAreCumulativeWithSumAndCount) {
  serve::Histogram h({0.25, 1, 2.5});
  for (double v : {0.125, 0.25, 0.75, 3.0}) h.observe(v);
  EXPECT_EQ(h.render("x_seconds"),
            "x_seconds_bucket{le=\"0.25\"} 2\n"  // le: a value equal to a bound is in its bucket
            "x_seconds_bucket{le=\"1\"} 3\n"
            "x_seconds_bucket{le=\"2.5\"} 3\n"
            "x_seconds_bucket{le=\"+Inf\"} 4\n"
            "x_seconds_sum 4.125\n"
            "x_seconds_count 4\n");
  serve::ServeMetrics m;
  m.request("/v1/completions", 200);
  m.request("/v1/completions", 200);
  m.request("other", 404);
  m.sequence(5, 7);
  serve::ServeGauges g;
  g.slots = 8;
  g.slots_busy = 3;
  const std::string text = m.render(g);
  EXPECT_NE(text.find("# TYPE kiln_requests_total counter\n"), std::string::npos) << text;
  EXPECT_NE(text.find("# TYPE kiln_time_to_first_token_seconds histogram\n"), std::string::npos) << text;
  const auto s = parse_exposition(text);
  EXPECT_EQ(s.at("kiln_requests_total{endpoint=\"/v1/completions\",status=\"200\"}"), 2);
  EXPECT_EQ(s.at("kiln_requests_total{endpoint=\"other\",status=\"404\"}"), 1);
  EXPECT_EQ(s.at("kiln_prompt_tokens_total"), 5);
  EXPECT_EQ(s.at("kiln_generation_tokens_total"), 7);
  EXPECT_EQ(s.at("kiln_slots"), 8);
  EXPECT_EQ(s.at("kiln_slots_busy"), 3);
  EXPECT_EQ(s.at("kiln_time_to_first_token_seconds_count"), 0);
}

TEST(ServeAccessLog, OneLineInAStableFormat) {
  EXPECT_EQ(serve::access_line("POST", "/v1/completions", 200, 5, 16, 41.66),
            "kiln: access: POST /v1/completions 200 prompt_tokens=5 completion_tokens=16 ms=41.7");
  // What a client put in the path cannot break the line apart.
  EXPECT_EQ(serve::access_line("GET", "/a b\n", 404, 0, 0, 0.04),
            "kiln: access: GET /a%20b%0A 404 prompt_tokens=0 completion_tokens=0 ms=0.0");
}

// Known requests on one kept-alive connection (each is counted before the connection
// takes its next request), then the page: counters, gauges and histogram counts exact.
TEST(ServeMetricsEndpoint, CountsTheRequestsAndTokensServed) {
  ByteTokenizer tokenizer;
  serve::ServeOptions options;
  options.model_name = "tiny";
  test::ServedModel served(tokenizer, options);
  httplib::Client c = served.client();
  c.set_keep_alive(true);
  const json body = {{"model", "tiny"}, {"prompt", {1, 2, 3}}, {"max_tokens", 3}, {"temperature", 0},
                     {"ignore_eos", true}};
  auto a = c.Post("/v1/completions", body.dump(), "application/json");
  ASSERT_TRUE(a);
  ASSERT_EQ(a->status, 200) << a->body;
  json streamed = body;
  streamed["stream"] = true;
  auto b = c.Post("/v1/completions", streamed.dump(), "application/json");
  ASSERT_TRUE(b);
  ASSERT_EQ(b->status, 200) << b->body;
  ASSERT_NE(b->body.find("data: [DONE]"), std::string::npos) << b->body;
  json wrong = body;
  wrong["model"] = "gpt-4";
  auto d = c.Post("/v1/completions", wrong.dump(), "application/json");
  ASSERT_TRUE(d);
  EXPECT_EQ(d->status, 404);
  ASSERT_TRUE(c.Get("/v1/models/tiny"));
  ASSERT_TRUE(c.Get("/nowhere"));
  ASSERT_TRUE(test::health_answers(served.port, 10));

  // A handler thread keeps a connection until the client has closed it, so those of the
  // requests above may still count as running for a moment: read until only the /metrics
  // request itself is (at most 5 s), then check everything on that page.
  auto page = c.Get("/metrics");
  int metrics_reads = 1;
  ASSERT_TRUE(page);
  auto s = parse_exposition(page->body);
  for (int attempt = 0; attempt < 100 && s.at("kiln_requests_running") != 1; ++attempt) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    page = c.Get("/metrics");
    ++metrics_reads;
    ASSERT_TRUE(page);
    s = parse_exposition(page->body);
  }
  ASSERT_EQ(page->status, 200);
  EXPECT_EQ(page->get_header_value("Content-Type"), "text/plain; version=0.0.4; charset=utf-8");
  auto requests = [&](const std::string& endpoint, int status) {
    const std::string key = fmt::format("kiln_requests_total{{endpoint=\"{}\",status=\"{}\"}}", endpoint, status);
    return s.count(key) ? s.at(key) : 0.0;
  };
  EXPECT_EQ(requests("/v1/completions", 200), 2) << page->body;
  EXPECT_EQ(requests("/v1/completions", 404), 1);
  EXPECT_EQ(requests("/v1/models/{id}", 200), 1);
  EXPECT_EQ(requests("other", 404), 1);  // never the raw path
  EXPECT_EQ(requests("/health", 200), 1);
  EXPECT_EQ(requests("/metrics", 200), metrics_reads - 1);  // counted once answered
  EXPECT_EQ(s.at("kiln_prompt_tokens_total"), 6);
  EXPECT_EQ(s.at("kiln_generation_tokens_total"), 6);
  EXPECT_EQ(s.at("kiln_sequences_total"), 2);
  EXPECT_EQ(s.at("kiln_time_to_first_token_seconds_count"), 2);  // one first token per sequence
  EXPECT_EQ(s.at("kiln_inter_token_latency_seconds_count"), 4);  // and two gaps after it
  EXPECT_EQ(s.at("kiln_inter_token_latency_seconds_bucket{le=\"+Inf\"}"), 4);
  EXPECT_LE(s.at("kiln_inter_token_latency_seconds_bucket{le=\"0.001\"}"),
            s.at("kiln_inter_token_latency_seconds_bucket{le=\"0.01\"}"));
  EXPECT_GT(s.at("kiln_time_to_first_token_seconds_sum"), 0);
  EXPECT_EQ(s.at("kiln_slots"), 4);
  EXPECT_EQ(s.at("kiln_slots_busy"), 0);
  EXPECT_EQ(s.at("kiln_sequences_waiting"), 0);
  EXPECT_EQ(s.at("kiln_requests_running"), 1);  // the /metrics request itself
  EXPECT_EQ(s.at("kiln_requests_waiting"), 0);

  page = c.Get("/metrics");
  ASSERT_TRUE(page);
  s = parse_exposition(page->body);
  EXPECT_EQ(requests("/metrics", 200), metrics_reads);
}

constexpr int kLongStream = 2000;

std::string long_stream_request() {
  const json body = {{"model", "slow"}, {"prompt", "x"},      {"max_tokens", kLongStream},
                     {"temperature", 0}, {"ignore_eos", true}, {"stream", true}};
  return test::http_request("POST", "/v1/completions", body.dump());
}

// True once a connection to `port` is refused (the server stopped listening), within `seconds`.
bool refused_within(int port, double seconds) {
  const auto deadline = test::after(seconds);
  while (test::Clock::now() < deadline) {
    test::RawConnection probe(port);
    if (!probe.connected()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

TEST(ServeOpsProcess, SigtermLetsAStreamFinishRefusesNewConnectionsAndExitsZero) {
  const std::string root = test::temp_dir("kiln-serve-ops");
  test::ServeProcess serve(test::slow_streaming_model(root), {"--threads", "1", "--slots", "1", "--shutdown-grace", "120"}, root);
  const int port = serve.wait_for_port(30);
  ASSERT_GT(port, 0) << serve.log();
  test::RawConnection c(port);
  ASSERT_TRUE(c.send(long_stream_request()));
  ASSERT_TRUE(c.read_through("data: {", 60)) << serve.log();
  serve.signal(SIGTERM);
  EXPECT_TRUE(refused_within(port, 10)) << "a new connection was still accepted after SIGTERM";
  const std::optional<std::string> rest = c.read_through("data: [DONE]\n\n", 120);
  ASSERT_TRUE(rest) << serve.log();
  EXPECT_EQ(rest->find("\"error\""), std::string::npos) << *rest;
  EXPECT_NE(rest->find("\"finish_reason\":\"length\""), std::string::npos);
  const auto done = test::Clock::now();
  EXPECT_EQ(serve.stop(), 0) << serve.log();
  EXPECT_LT(test::seconds_since(done), 5) << "the server took long to exit once its last request was answered";
  const std::string log = serve.log();
  EXPECT_TRUE(std::regex_search(log, std::regex(fmt::format(
                                         "kiln: access: POST /v1/completions 200 prompt_tokens=[1-9][0-9]* "
                                         "completion_tokens={} ms=[0-9]+\\.[0-9]\n",
                                         kLongStream))))
      << log;
  EXPECT_NE(log.find("SIGTERM: stopping"), std::string::npos) << log;
  EXPECT_EQ(log.find("cut off"), std::string::npos) << log;
  fs::remove_all(root);
}

TEST(ServeOpsProcess, AStreamPastTheShutdownBoundIsCutOffAndNamed) {
  const std::string root = test::temp_dir("kiln-serve-ops-cut");
  test::ServeProcess serve(test::slow_streaming_model(root), {"--threads", "1", "--slots", "1", "--shutdown-grace", "0"}, root);
  const int port = serve.wait_for_port(30);
  ASSERT_GT(port, 0) << serve.log();
  test::RawConnection c(port);
  ASSERT_TRUE(c.send(long_stream_request()));
  ASSERT_TRUE(c.read_through("data: {", 60)) << serve.log();
  const auto signalled = test::Clock::now();
  serve.signal(SIGTERM);
  const std::optional<std::string> rest = c.read_through("data: [DONE]\n\n", 30);
  ASSERT_TRUE(rest) << serve.log();
  EXPECT_NE(rest->find("data: {\"error\""), std::string::npos) << *rest;  // the stream says why it ended
  EXPECT_EQ(serve.stop(), 0) << serve.log();
  EXPECT_LT(test::seconds_since(signalled), 10);
  const std::string log = serve.log();
  EXPECT_NE(log.find("; 1 request in progress cut off at the shutdown bound"), std::string::npos) << log;
  fs::remove_all(root);
}

}  // namespace
}  // namespace kiln

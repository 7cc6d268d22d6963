// A bounded load test of the `kiln serve` binary on loopback: 200 concurrent completion
// requests (every fourth streamed as server-sent events), 8 clients trickling their request
// a header line at a time, and /health probed throughout. Every completion, streamed or not,
// must match the same request served alone (greedy, so deterministic), every slow client must be cut off with 408 at the request deadline, and
// /health must never fail. The numbers are printed (docs/reliability.md quotes them).
#include "serve_fixture.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fmt/format.h>

namespace kiln {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using test::Clock;
using test::seconds_since;

// 200 concurrent requests over 40 distinct prompts (each asked 5 times at once), so the
// answers alone, asked one by one first, take a fifth of the time.
constexpr int kRequests = 200, kDistinct = 40, kSlowClients = 8;
constexpr double kRequestTimeout = 2;

TEST(ServeLoad, ConcurrentRequestsSlowClientsAndHealthTogether) {
  const auto test_start = Clock::now();
  const std::string root = test::temp_dir("kiln-serve-load");
  const std::string model = test::save_random_model(test::tiny_config(true, true, false), root + "/model");
  // 32 handler threads and 32 slots: a handler waits for its request's generation, so the
  // threads bound how many requests the model batches at once.
  test::ServeProcess serve(model, {"--threads", "1", "--slots", "32", "--http-threads", "32", "--request-timeout", "2"},
                           root);
  const int port = serve.wait_for_port();
  ASSERT_GT(port, 0) << serve.log();

  // Every fourth of the concurrent requests streams; the answers alone never do.
  auto streamed = [](int i) { return i >= kDistinct && i % 4 == 0; };
  auto body = [&](int i) {
    json b = {{"prompt", fmt::format("load request {} says", i % kDistinct)},
              {"max_tokens", 2 + i % kDistinct % 3},
              {"temperature", 0},
              {"ignore_eos", true}};
    if (streamed(i)) b["stream"] = true;
    return b.dump();
  };
  // The completion's text, from a whole answer or from its events' pieces ("" if none).
  auto text_of = [&](int i, const std::string& answer) -> std::string {
    if (!streamed(i)) return json::parse(answer)["choices"][0]["text"].dump();
    std::string text;
    bool done = false;
    for (size_t at = 0; (at = answer.find("data: ", at)) != std::string::npos;) {
      const size_t end = answer.find("\n\n", at);
      const std::string data = answer.substr(at + 6, end - at - 6);
      at = end;
      if (data == "[DONE]") done = true;
      else if (!json::parse(data)["choices"].empty()) text += json::parse(data)["choices"][0]["text"].get<std::string>();
    }
    return done ? json(text).dump() : std::string();
  };
  auto ask = [&](int i, int* status, int* retries) -> std::string {
    httplib::Client c("127.0.0.1", port);
    c.set_connection_timeout(10, 0);
    c.set_read_timeout(300, 0);  // correctness is the test, not speed: a loaded machine may be slow
    for (int attempt = 0; attempt < 20; ++attempt) {
      auto res = c.Post("/v1/completions", body(i), "application/json");
      if (res && res->status == 503) {  // backpressure: wait as told, then again
        ++*retries;
        std::this_thread::sleep_for(std::chrono::seconds(std::max(1, std::atoi(res->get_header_value("Retry-After").c_str()))));
        continue;
      }
      *status = res ? res->status : -1;
      return res && res->status == 200 ? text_of(i, res->body) : std::string();
    }
    return "";
  };

  // Each request alone, one after another, none streamed: the answers to match.
  std::vector<std::string> alone(kDistinct);
  int status = 0, retries = 0;
  for (int i = 0; i < kDistinct; ++i) {
    alone[static_cast<size_t>(i)] = ask(i, &status, &retries);
    ASSERT_EQ(status, 200) << "request " << i << " alone";
  }

  std::atomic<bool> loaded{true};
  std::atomic<int> probes{0}, probe_failures{0};
  std::atomic<int64_t> worst_probe_ms{0};
  std::thread prober([&] {
    while (loaded) {
      const auto start = Clock::now();
      if (!test::health_answers(port, 5)) ++probe_failures;
      ++probes;
      worst_probe_ms = std::max<int64_t>(worst_probe_ms, static_cast<int64_t>(seconds_since(start) * 1000));
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
  std::vector<int> slow_status(kSlowClients, 0);
  std::vector<double> slow_cut(kSlowClients, -1);
  std::vector<std::thread> slow;
  for (int i = 0; i < kSlowClients; ++i)
    slow.emplace_back([&, i] {
      test::RawConnection c(port);
      const auto start = Clock::now();
      if (!c.send("POST /v1/completions HTTP/1.1\r\n")) return;
      for (int line = 0; line < 40; ++line) {
        if (const auto r = c.read_response(0.25)) {
          slow_status[static_cast<size_t>(i)] = r->status;
          slow_cut[static_cast<size_t>(i)] = seconds_since(start);
          return;
        }
        if (!c.send(fmt::format("X-Slow-{}: y\r\n", line))) return;
      }
    });
  const auto load_start = Clock::now();
  std::vector<std::string> loaded_answers(kRequests);
  std::vector<int> statuses(kRequests, 0), retried(kRequests, 0);
  std::vector<double> latency(kRequests, 0);
  std::vector<std::thread> clients;
  for (int i = 0; i < kRequests; ++i)
    clients.emplace_back([&, i] {
      const auto start = Clock::now();
      const auto k = static_cast<size_t>(i);
      loaded_answers[k] = ask(i, &statuses[k], &retried[k]);
      latency[k] = seconds_since(start);
    });
  for (auto& t : clients) t.join();
  const double load_seconds = seconds_since(load_start);
  for (auto& t : slow) t.join();
  loaded = false;
  prober.join();

  int matched = 0, total_retries = 0, streams = 0;
  for (int i = 0; i < kRequests; ++i) {
    const auto k = static_cast<size_t>(i);
    EXPECT_EQ(statuses[k], 200) << "request " << i;
    const std::string& want = alone[k % kDistinct];
    EXPECT_EQ(loaded_answers[k], want) << "request " << i;
    matched += statuses[k] == 200 && loaded_answers[k] == want;
    streams += streamed(i);
    total_retries += retried[k];
  }
  for (int i = 0; i < kSlowClients; ++i) {
    const auto k = static_cast<size_t>(i);
    EXPECT_EQ(slow_status[k], 408) << "slow client " << i;
    EXPECT_GE(slow_cut[k], kRequestTimeout - 0.1) << "slow client " << i;
    EXPECT_LE(slow_cut[k], kRequestTimeout + 8) << "slow client " << i;
  }
  EXPECT_EQ(probe_failures, 0);
  EXPECT_GT(probes, 0);
  std::sort(latency.begin(), latency.end());
  const auto [slowest_cut, fastest_cut] = std::pair{*std::max_element(slow_cut.begin(), slow_cut.end()),
                                                    *std::min_element(slow_cut.begin(), slow_cut.end())};
  EXPECT_EQ(streams, kRequests / 4 - 10);  // every fourth, the first 40 (the ones asked alone too) aside
  fmt::print("serve load: {} of {} concurrent requests ({} streamed) answered as alone in {:.2f} s (latency p50 {:.3f} s, max "
             "{:.3f} s, {} retries after 503); {} slow clients cut at {:.2f}-{:.2f} s; /health {} probes, {} failed, "
             "slowest {} ms; test wall {:.1f} s\n",
             matched, kRequests, streams, load_seconds, latency[kRequests / 2], latency.back(), total_retries, kSlowClients,
             fastest_cut, slowest_cut, probes.load(), probe_failures.load(), worst_probe_ms.load(),
             seconds_since(test_start));
  EXPECT_EQ(serve.stop(), 0) << serve.log();
  fs::remove_all(root);
}

}  // namespace
}  // namespace kiln

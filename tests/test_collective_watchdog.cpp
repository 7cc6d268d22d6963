// The collectives' watchdog (dist/collective_watchdog.h): collectives that finish in time
// are dropped without a word; the oldest one still running after the timeout is reported
// once, by name, no sooner than the timeout; the ones behind it are not reported too.
#include "dist/collective_watchdog.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace kiln::dist {
namespace {

using namespace std::chrono_literals;

struct Reports {
  std::mutex mutex;
  std::vector<std::pair<std::string, double>> seen;
  void add(const std::string& what, double waited_s) {
    std::lock_guard<std::mutex> lock(mutex);
    seen.emplace_back(what, waited_s);
  }
  size_t size() {
    std::lock_guard<std::mutex> lock(mutex);
    return seen.size();
  }
};

TEST(CollectiveWatchdog, CollectivesFinishedInTimeAreDroppedSilently) {
  Reports reports;
  CollectiveWatchdog watchdog(300ms, [&](const std::string& w, double s) { reports.add(w, s); }, 5ms);
  std::atomic<bool> first{false}, second{false};
  watchdog.watch("gradients", [&] { return first.load(); });
  watchdog.watch("loss sums", [&] { return second.load(); });
  EXPECT_EQ(watchdog.pending(), 2u);
  std::this_thread::sleep_for(100ms);
  first = true, second = true;
  const auto deadline = std::chrono::steady_clock::now() + 2s;
  while (watchdog.pending() > 0 && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(5ms);
  EXPECT_EQ(watchdog.pending(), 0u);
  std::this_thread::sleep_for(400ms);  // past the timeout: nothing is late any more
  EXPECT_EQ(reports.size(), 0u);
  EXPECT_FALSE(watchdog.fired());
}

TEST(CollectiveWatchdog, TheOldestLateCollectiveIsReportedOnceByName) {
  Reports reports;
  CollectiveWatchdog watchdog(200ms, [&](const std::string& w, double s) { reports.add(w, s); }, 5ms);
  std::atomic<bool> done{false};
  const auto start = std::chrono::steady_clock::now();
  watchdog.watch("step statistics", [&] { return done.load(); });  // finishes: dropped
  done = true;
  watchdog.watch("gradients", [] { return false; });  // never finishes: late
  watchdog.watch("loss sums", [] { return false; });  // behind it: not reported too
  const auto deadline = start + 3s;
  while (reports.size() == 0 && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(5ms);
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::this_thread::sleep_for(300ms);  // time for a second report, which must not come
  ASSERT_EQ(reports.size(), 1u);
  EXPECT_EQ(reports.seen[0].first, "gradients");
  EXPECT_GE(reports.seen[0].second, 0.2);
  EXPECT_GE(elapsed, 0.2);
  EXPECT_LT(elapsed, 2.0);
  EXPECT_TRUE(watchdog.fired());
  watchdog.watch("after the report", [] { return false; });  // watched no more
  EXPECT_EQ(watchdog.pending(), 0u);
}

}  // namespace
}  // namespace kiln::dist

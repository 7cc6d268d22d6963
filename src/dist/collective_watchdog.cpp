#include "dist/collective_watchdog.h"

namespace kiln::dist {

CollectiveWatchdog::CollectiveWatchdog(std::chrono::milliseconds timeout, OnTimeout on_timeout,
                                       std::chrono::milliseconds poll)
    : timeout_(timeout), poll_(poll), on_timeout_(std::move(on_timeout)), thread_([this] { run(); }) {}

CollectiveWatchdog::~CollectiveWatchdog() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

void CollectiveWatchdog::watch(std::string what, Finished finished) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (fired_) return;
  watched_.push_back({std::move(what), std::move(finished), std::chrono::steady_clock::now()});
}

size_t CollectiveWatchdog::pending() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return watched_.size();
}

bool CollectiveWatchdog::fired() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return fired_;
}

void CollectiveWatchdog::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stopping_) {
    wake_.wait_for(lock, poll_, [this] { return stopping_; });
    // Streams finish their work in order: drop the finished from the front; the first
    // unfinished one is the oldest still running.
    while (!watched_.empty() && watched_.front().finished()) watched_.pop_front();
    if (watched_.empty() || fired_) continue;
    const auto waited = std::chrono::steady_clock::now() - watched_.front().since;
    if (waited < timeout_) continue;
    fired_ = true;
    const Watched late = std::move(watched_.front());
    watched_.clear();
    lock.unlock();  // the action may take its time (or never return: it may exit)
    on_timeout_(late.what, std::chrono::duration<double>(waited).count());
    lock.lock();
  }
}

}  // namespace kiln::dist

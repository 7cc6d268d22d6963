#include "data/prefetch.h"

#include "core/error.h"
#include "ops/parallel.h"

#include <chrono>

namespace kiln {

Prefetcher::Prefetcher(int64_t depth, Produce produce) : produce_(std::move(produce)) {
  KILN_CHECK(depth > 0, "data.prefetch", "must be positive to prefetch, got {}", depth);
  slots_.resize(static_cast<size_t>(depth));
  states_.resize(static_cast<size_t>(depth));
  thread_ = start_cpu_thread([this] { run(); });  // any OpenMP loop in produce_ keeps train.threads
}

Prefetcher::~Prefetcher() {
  {
    const std::lock_guard lock(mutex_);
    stop_ = true;
  }
  freed_.notify_all();
  thread_.join();
}

void Prefetcher::run() {
  for (;;) {
    size_t slot;
    {
      std::unique_lock lock(mutex_);
      freed_.wait(lock, [&] { return stop_ || count_ < slots_.size(); });
      if (stop_) return;
      slot = (head_ + count_) % slots_.size();
    }
    // The slot is the producer's until count_ covers it: the consumer never reads it.
    try {
      states_[slot] = produce_(slots_[slot]);
    } catch (...) {
      const std::lock_guard lock(mutex_);
      error_ = std::current_exception();
      filled_.notify_all();
      return;
    }
    {
      const std::lock_guard lock(mutex_);
      ++count_;
    }
    filled_.notify_one();
  }
}

StreamState Prefetcher::next(HostBatch& batch) {
  std::unique_lock lock(mutex_);
  if (count_ == 0 && !error_) {
    const auto start = std::chrono::steady_clock::now();
    filled_.wait(lock, [&] { return count_ > 0 || error_; });
    wait_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  if (count_ == 0) std::rethrow_exception(error_);
  std::swap(batch, slots_[head_]);
  const StreamState state = states_[head_];
  head_ = (head_ + 1) % slots_.size();
  --count_;
  lock.unlock();
  freed_.notify_one();
  return state;
}

}  // namespace kiln

#include "serve/worker_pool.h"

namespace kiln::serve {

WorkerPool::WorkerPool(size_t threads, size_t capacity) : capacity_(capacity) {
  for (size_t i = 0; i < std::max<size_t>(1, threads); ++i) threads_.emplace_back([this] { work(); });
}

WorkerPool::~WorkerPool() { shutdown(); }

bool WorkerPool::try_post(std::function<void()>& job) {
  {
    std::lock_guard lock(mutex_);
    if (!open_ || jobs_.size() >= capacity_) return false;
    jobs_.push_back(std::move(job));
  }
  wake_.notify_one();
  return true;
}

void WorkerPool::shutdown() {
  {
    std::lock_guard lock(mutex_);
    open_ = false;
  }
  wake_.notify_all();
  for (std::thread& t : threads_)
    if (t.joinable()) t.join();
}

void WorkerPool::work() {
  for (;;) {
    std::function<void()> job;
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [&] { return !jobs_.empty() || !open_; });
      if (jobs_.empty()) return;  // shut down and drained
      job = std::move(jobs_.front());
      jobs_.pop_front();
      ++busy_;
    }
    job();
    std::lock_guard lock(mutex_);
    --busy_;
  }
}

size_t WorkerPool::busy() const {
  std::lock_guard lock(mutex_);
  return busy_;
}

size_t WorkerPool::queued() const {
  std::lock_guard lock(mutex_);
  return jobs_.size();
}

}  // namespace kiln::serve

// The HTTP handler threads of `kiln serve`, with a bounded queue. httplib 0.11's
// ThreadPool queues without limit and its TaskQueue::enqueue cannot refuse a job, so a
// burst past what the threads can take would pile up unseen; here try_post() refuses a
// job once `capacity` are waiting, and the caller answers 503 with Retry-After at once.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace kiln::serve {

class WorkerPool {
 public:
  WorkerPool(size_t threads, size_t capacity);
  ~WorkerPool();  // shutdown()
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  // Queues `job` for a thread; false (and `job` not taken) when `capacity` jobs wait
  // already or the pool is shut down.
  bool try_post(std::function<void()>& job);
  // Runs what is queued, then joins the threads.
  void shutdown();

  size_t busy() const;    // jobs running now
  size_t queued() const;  // jobs waiting for a thread

 private:
  void work();

  const size_t capacity_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::function<void()>> jobs_;
  size_t busy_ = 0;
  bool open_ = true;
  std::vector<std::thread> threads_;
};

}  // namespace kiln::serve

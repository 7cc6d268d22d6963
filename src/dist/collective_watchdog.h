// A bound on how long a collective may take where nothing else bounds it (issue 39). NCCL
// enqueues a collective on a stream and returns at once; if a peer has died or hangs, the
// collective spins on the GPU for ever and the host blocks at its next synchronization
// without a word, where Gloo would have timed out after dist.timeout. The watchdog polls
// each watched collective's completion from a thread of its own; the first one not
// finished within the timeout is reported once, naming it, through `on_timeout` (NCCL's:
// abort the communicator and exit non-zero, dist/nccl_communicator.cu).
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace kiln::dist {

class CollectiveWatchdog {
 public:
  using Finished = std::function<bool()>;  // polled from the watchdog's thread
  using OnTimeout = std::function<void(const std::string& what, double waited_s)>;

  CollectiveWatchdog(std::chrono::milliseconds timeout, OnTimeout on_timeout,
                     std::chrono::milliseconds poll = std::chrono::milliseconds(50));
  ~CollectiveWatchdog();
  CollectiveWatchdog(const CollectiveWatchdog&) = delete;
  CollectiveWatchdog& operator=(const CollectiveWatchdog&) = delete;

  // Watches one collective from now: `finished` says when it has. Collectives are watched
  // in the order they run, so the oldest unfinished one is the one that is late.
  void watch(std::string what, Finished finished);
  // Collectives watched and not yet seen finished.
  size_t pending() const;
  // Whether a timeout was reported (then the watchdog watches nothing more).
  bool fired() const;

 private:
  struct Watched {
    std::string what;
    Finished finished;
    std::chrono::steady_clock::time_point since;
  };
  void run();

  const std::chrono::milliseconds timeout_, poll_;
  const OnTimeout on_timeout_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<Watched> watched_;
  bool stopping_ = false, fired_ = false;
  std::thread thread_;
};

}  // namespace kiln::dist

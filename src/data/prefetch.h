// Prefetcher: a background thread that packs the next micro-batches while the step runs,
// so the consumer's next() returns at once.
//
// A ring of `depth` HostBatch slots: the producer fills free slots in order, the consumer
// takes them in the same order by swapping buffers (its previous batch's buffers go back
// to the ring), so once each of the depth + 1 buffers has reached its capacity nothing
// allocates. Each slot carries the stream position *after* its batch, and the consumer
// keeps the position after the last batch it received: a checkpoint taken between
// steps saves where the consumer is, never how far the producer ran ahead.
#pragma once

#include "data/batch.h"
#include "data/stream_state.h"

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace kiln {

class Prefetcher {
 public:
  // `produce` fills a batch and returns the stream state after it; it runs on the
  // background thread only, from construction until destruction. An exception it throws
  // reaches the consumer at the next() that would have returned that batch.
  using Produce = std::function<StreamState(HostBatch&)>;
  Prefetcher(int64_t depth, Produce produce);
  // Stops the producer (discarding batches not yet taken) and joins it.
  ~Prefetcher();
  Prefetcher(const Prefetcher&) = delete;
  Prefetcher& operator=(const Prefetcher&) = delete;

  // The next batch, in production order, swapped into `batch`; returns the state after it.
  StreamState next(HostBatch& batch);

  // Total seconds next() spent waiting for the producer.
  double wait_seconds() const { return wait_seconds_; }
  int64_t depth() const { return static_cast<int64_t>(slots_.size()); }

 private:
  void run();

  Produce produce_;
  std::vector<HostBatch> slots_;
  std::vector<StreamState> states_;
  size_t head_ = 0;   // next slot the consumer takes
  size_t count_ = 0;  // filled slots
  bool stop_ = false;
  std::exception_ptr error_;
  std::mutex mutex_;
  std::condition_variable filled_;
  std::condition_variable freed_;
  double wait_seconds_ = 0;
  std::thread thread_;  // last: starts after every member above exists
};

}  // namespace kiln

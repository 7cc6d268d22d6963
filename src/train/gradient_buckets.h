// Data parallelism's gradient reduction in buckets, overlapped with backward (issue 39
// stage e). The flat gradient (Model::all_gradients) is cut into buckets of about
// dist.bucket_mb, at parameter boundaries, from the end of the arena (the head and the
// last blocks, whose gradients backward finishes first) to its start. A bucket is reduced
// as soon as backward has finished every gradient in it (model/gradient_ready.h), while
// backward goes on with the blocks below; the step waits for the last bucket only before
// it reads the gradients (the norm). Every rank launches the buckets in the same order.
//
// On the CPU (Gloo) the reductions run on a thread of their own, the communication
// "stream": backward's threads keep computing while it sends and sums. On the GPU (NCCL)
// they run on a communication stream ordered by events, inside the captured micro-batch
// (train/stream_gradient_buckets.h).
#pragma once

#include "core/tensor.h"
#include "dist/communicator.h"
#include "model/gradient_ready.h"

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace kiln {

// Elements [begin, end) of the flat gradient, reduced once backward has finished event
// `ready_after`.
struct GradientBucket {
  int64_t begin = 0, end = 0;
  int ready_after = 0;
};

// Buckets covering [0, total) (padding between tensors included), each holding whole
// ranges and, where a range allows, at most bucket_elements elements; in launch order: from
// the end of the arena to its start. `ranges` are sorted by begin, disjoint, within total.
std::vector<GradientBucket> plan_gradient_buckets(const std::vector<GradientRange>& ranges, int64_t total,
                                                  int64_t bucket_elements);

// Which of a step's buckets backward has made ready and which are launched, so that every
// rank launches the same buckets in the same order.
class BucketLaunches {
 public:
  explicit BucketLaunches(const std::vector<GradientBucket>& buckets) : buckets_(buckets), launched_(buckets.size()) {}
  // A step's last backward begins: none launched.
  void reset() { std::fill(launched_.begin(), launched_.end(), false); }
  // The buckets ready after backward's `event` and not launched yet, in plan order, now
  // marked launched.
  std::vector<size_t> take_ready(int event);

 private:
  const std::vector<GradientBucket>& buckets_;
  std::vector<bool> launched_;
};

// A step's bucketed reduction as backward drives it: the CPU's on a thread (below), the
// GPU's on a communication stream (train/stream_gradient_buckets.h).
class BucketReduction {
 public:
  virtual ~BucketReduction() = default;
  // A step's last backward begins: no bucket launched yet.
  virtual void start() = 0;
  // Backward finished `event`: the buckets ready after it (and not yet launched) go out,
  // in plan order.
  virtual void ready(int event) = 0;
  // Launches what is left; then whoever reads the gradients next waits for every bucket
  // (the CPU's caller here; the GPU's stream, without a host wait).
  virtual void finish() = 0;
  virtual const std::vector<GradientBucket>& buckets() const = 0;
};

// The CPU's communication "stream": a thread of its own that runs each bucket's collective
// (and what goes with it) in the order the buckets are handed over -- plan order, the same
// on every rank -- while backward's threads go on computing. Used by DDP's all-reduce
// (below) and ZeRO-2's reduce-scatter (train/sharded_gradients.h).
class BucketThread {
 public:
  // `communicate(b)`: bucket b's work, run on the thread once backward has made it ready.
  BucketThread(const std::vector<GradientBucket>& buckets, std::function<void(size_t)> communicate);
  ~BucketThread();
  BucketThread(const BucketThread&) = delete;
  BucketThread& operator=(const BucketThread&) = delete;

  // A backward begins: no bucket launched (the last backward's all done: wait() ran).
  void start();
  // Backward finished `event`: the buckets ready after it, not yet launched, go to the
  // thread. Returns how many.
  size_t ready(int event);
  // Waits until at most `in_flight` of the buckets handed over are not done (0: all done; the
  // queue is in order, so n: all but the last n handed over); rethrows the first error of
  // the thread (a rank lost, a timeout). Buckets not launched stay so (ready(INT_MAX) launches them).
  void wait(size_t in_flight = 0);

 private:
  void run();  // the thread

  BucketLaunches launches_;
  std::function<void(size_t)> communicate_;
  std::mutex mutex_;
  std::condition_variable work_, done_;
  std::deque<size_t> queue_;  // buckets handed over, not yet taken
  size_t in_flight_ = 0;      // handed over and not yet done
  bool stopping_ = false;
  std::exception_ptr error_;
  std::thread thread_;
};

class BucketedGradientReduction final : public BucketReduction {
 public:
  // Reduces (sums) buckets of `gradients` over `comm`'s ranks on a thread of its own.
  BucketedGradientReduction(dist::Communicator& comm, const Tensor& gradients, std::vector<GradientBucket> buckets);

  void start() override { thread_.start(); }
  // Hands the ready buckets to the communication thread.
  void ready(int event) override { thread_.ready(event); }
  // Waits until every bucket is reduced; rethrows the first error of the communication
  // thread (a rank lost, a timeout).
  void finish() override;

  const std::vector<GradientBucket>& buckets() const override { return buckets_; }

 private:
  void reduce(size_t bucket);  // on the thread

  dist::Communicator& comm_;
  Tensor gradients_;
  std::vector<GradientBucket> buckets_;
  BucketThread thread_;  // last: its thread starts once the rest is made
};

}  // namespace kiln

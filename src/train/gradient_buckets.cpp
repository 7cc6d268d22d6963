#include "train/gradient_buckets.h"

#include "core/error.h"

#include <algorithm>
#include <limits>

namespace kiln {

std::vector<GradientBucket> plan_gradient_buckets(const std::vector<GradientRange>& ranges, int64_t total,
                                                  int64_t bucket_elements) {
  KILN_CHECK(bucket_elements > 0, "dist", "a bucket must hold at least one element");
  std::vector<GradientBucket> buckets;
  int64_t end = total;  // the open bucket's end: the last bucket's start, or the arena's end
  GradientBucket open{total, total, 0};
  for (size_t i = ranges.size(); i-- > 0;) {
    const GradientRange& r = ranges[i];
    KILN_CHECK(r.begin >= 0 && r.begin <= r.end && r.end <= end, "dist", "gradient ranges overlap or leave the arena");
    open.begin = r.begin;
    open.ready_after = std::max(open.ready_after, r.ready_after);
    // Closed once it holds enough; the first range of the arena closes the last one.
    if (open.end - open.begin >= bucket_elements) {
      buckets.push_back(open);
      end = open.begin;
      open = GradientBucket{end, end, 0};
    }
  }
  // What is left, down to the arena's start (padding before the first range included).
  open.begin = 0;
  if (open.end > 0) buckets.push_back(open);
  return buckets;
}

std::vector<size_t> BucketLaunches::take_ready(int event) {
  std::vector<size_t> ready;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    if (launched_[b] || buckets_[b].ready_after > event) continue;
    launched_[b] = true;
    ready.push_back(b);
  }
  return ready;
}

BucketThread::BucketThread(const std::vector<GradientBucket>& buckets, std::function<void(size_t)> communicate)
    : launches_(buckets), communicate_(std::move(communicate)) {
  thread_ = std::thread([this] { run(); });
}

BucketThread::~BucketThread() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  work_.notify_all();
  thread_.join();
}

void BucketThread::start() {
  std::lock_guard<std::mutex> lock(mutex_);
  KILN_CHECK(queue_.empty() && in_flight_ == 0, "dist", "a bucketed reduction started before the last one finished");
  launches_.reset();
}

size_t BucketThread::ready(int event) {
  std::lock_guard<std::mutex> lock(mutex_);
  const std::vector<size_t> ready = launches_.take_ready(event);
  queue_.insert(queue_.end(), ready.begin(), ready.end());
  in_flight_ += ready.size();
  if (!ready.empty()) work_.notify_one();
  return ready.size();
}

void BucketThread::wait(size_t in_flight) {
  std::unique_lock<std::mutex> lock(mutex_);
  done_.wait(lock, [&] { return in_flight_ <= in_flight; });
  if (error_) {
    std::exception_ptr error = error_;
    error_ = nullptr;
    std::rethrow_exception(error);
  }
}

void BucketThread::run() {
  for (;;) {
    size_t b = 0;
    bool failed = false;  // after an error the rest are only counted off: the step fails at wait()
    {
      std::unique_lock<std::mutex> lock(mutex_);
      work_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, nothing left
      b = queue_.front();
      queue_.pop_front();
      failed = error_ != nullptr;
    }
    try {
      if (!failed) communicate_(b);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex_);
      error_ = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      --in_flight_;
    }
    done_.notify_all();
  }
}

BucketedGradientReduction::BucketedGradientReduction(dist::Communicator& comm, const Tensor& gradients,
                                                     std::vector<GradientBucket> buckets)
    : comm_(comm), gradients_(gradients), buckets_(std::move(buckets)), thread_(buckets_, [this](size_t b) { reduce(b); }) {
  KILN_CHECK(gradients.device() == Device::cpu, "dist",
             "buckets reduced during backward run on the CPU (Gloo) only; got gradients on {}",
             device_name(gradients.device()));
}

void BucketedGradientReduction::finish() {
  thread_.ready(std::numeric_limits<int>::max());
  thread_.wait();
}

void BucketedGradientReduction::reduce(size_t b) {
  const size_t element = dtype_size(gradients_.dtype());
  const GradientBucket& bucket = buckets_[b];
  comm_.all_reduce(static_cast<unsigned char*>(gradients_.raw()) + static_cast<size_t>(bucket.begin) * element,
                   bucket.end - bucket.begin, gradients_.dtype(), dist::ReduceOp::sum, "gradients");
}

}  // namespace kiln

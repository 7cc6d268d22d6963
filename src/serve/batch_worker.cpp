#include "serve/batch_worker.h"

#include "ops/parallel.h"

#include <stdexcept>

namespace kiln::serve {

BatchWorker::BatchWorker(Generator& generator, int64_t max_pending)
    : generator_(generator), max_pending_(max_pending), thread_(start_cpu_thread([this] { loop(); })) {}

BatchWorker::~BatchWorker() { stop(); }

std::vector<std::future<GenerationResult>> BatchWorker::submit(std::vector<GenerationRequest> sequences) {
  for (const GenerationRequest& r : sequences) generator_.validate(r);
  std::vector<std::future<GenerationResult>> futures;
  {
    std::lock_guard lock(mutex_);
    if (!running_) throw std::length_error("the server is shutting down");
    if (in_flight_ + static_cast<int64_t>(sequences.size()) > max_pending_)
      throw std::length_error("too many sequences queued; try again later");
    for (GenerationRequest& r : sequences) {
      std::promise<GenerationResult> promise;
      futures.push_back(promise.get_future());
      pending_.emplace_back(std::move(r), std::move(promise));
    }
    in_flight_ += static_cast<int64_t>(sequences.size());
  }
  wake_.notify_one();
  return futures;
}

void BatchWorker::loop() {
  for (;;) {
    std::vector<std::pair<GenerationRequest, std::promise<GenerationResult>>> incoming;
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [&] { return !pending_.empty() || !running_ || !generator_.idle(); });
      if (!running_) break;
      incoming.swap(pending_);
    }
    for (auto& [request, promise] : incoming) {
      auto shared = std::make_shared<std::promise<GenerationResult>>(std::move(promise));
      generator_.submit(std::move(request), [this, shared](GenerationResult&& r) {
        shared->set_value(std::move(r));
        std::lock_guard lock(mutex_);
        --in_flight_;
      });
    }
    const int64_t batch = generator_.active() + generator_.queued();
    try {
      generator_.step();
    } catch (const std::exception& e) {
      // The shared forward failed: it fails the sequences that were in it, not those
      // still waiting for a slot (a sequence's own failure never gets here: step() ends
      // that sequence alone).
      generator_.fail_active(std::string("model step failed: ") + e.what());
    }
    std::lock_guard lock(mutex_);
    ++steps_;
    max_batch_ = std::max(max_batch_, batch);
  }
  generator_.abort("the server is shutting down");
  std::lock_guard lock(mutex_);
  for (auto& [request, promise] : pending_) {
    GenerationResult r;
    r.error = "the server is shutting down";
    r.finish_reason = "error";
    promise.set_value(std::move(r));
  }
  pending_.clear();
}

void BatchWorker::stop() {
  {
    std::lock_guard lock(mutex_);
    running_ = false;
  }
  wake_.notify_one();
  if (thread_.joinable()) thread_.join();
}

int64_t BatchWorker::steps() const {
  std::lock_guard lock(mutex_);
  return steps_;
}

int64_t BatchWorker::in_flight() const {
  std::lock_guard lock(mutex_);
  return in_flight_;
}

int64_t BatchWorker::max_batch() const {
  std::lock_guard lock(mutex_);
  return max_batch_;
}

}  // namespace kiln::serve

#include "serve/batch_worker.h"

#include "ops/parallel.h"
#include "serve/access_log.h"

#include <chrono>
#include <stdexcept>

namespace kiln::serve {

namespace {

using Clock = std::chrono::steady_clock;

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// One sequence's token times, for the latency histograms. The generator reports every
// token but the last through on_token (on the model's thread) and the last through done.
struct TokenTimes {
  Clock::time_point submitted = Clock::now(), last{};
  size_t seen = 0;
  void token(ServeMetrics& metrics) {
    const auto now = Clock::now();
    if (seen++ == 0)
      metrics.time_to_first_token(seconds(now - submitted));
    else
      metrics.inter_token_latency(seconds(now - last));
    last = now;
  }
};

}  // namespace

BatchWorker::BatchWorker(Generator& generator, int64_t max_pending, ServeMetrics* metrics)
    : generator_(generator),
      max_pending_(max_pending),
      metrics_(metrics),
      thread_(start_cpu_thread([this] { loop(); })) {}

BatchWorker::~BatchWorker() { stop(); }

void BatchWorker::submit(std::vector<GenerationRequest> sequences, Done done) {
  for (const GenerationRequest& r : sequences) generator_.validate(r);
  auto shared = std::make_shared<Done>(std::move(done));
  const std::shared_ptr<RequestTally> tally = current_tally();
  std::vector<std::shared_ptr<TokenTimes>> times(sequences.size());
  if (metrics_)
    for (size_t i = 0; i < sequences.size(); ++i) {
      times[i] = std::make_shared<TokenTimes>();
      sequences[i].on_token = [t = times[i], m = metrics_, inner = std::move(sequences[i].on_token)](
                                  const GenerationResult& r) {
        t->token(*m);
        if (inner) inner(r);
      };
    }
  {
    std::lock_guard lock(mutex_);
    if (!running_) throw std::length_error("the server is shutting down");
    if (in_flight_ + static_cast<int64_t>(sequences.size()) > max_pending_)
      throw std::length_error("too many sequences queued; try again later");
    for (size_t i = 0; i < sequences.size(); ++i)
      pending_.emplace_back(std::move(sequences[i]), [this, shared, i, tally, t = times[i]](GenerationResult&& r) {
        const auto generated = static_cast<int64_t>(r.tokens.size());
        if (t && r.tokens.size() > t->seen) t->token(*metrics_);  // the last token
        if (metrics_) metrics_->sequence(r.prompt_tokens, generated);
        if (tally) {
          tally->prompt_tokens += r.prompt_tokens;
          tally->completion_tokens += generated;
        }
        (*shared)(i, std::move(r));
        std::lock_guard lock(mutex_);
        --in_flight_;
      });
    in_flight_ += static_cast<int64_t>(sequences.size());
  }
  wake_.notify_one();
}

std::vector<std::future<GenerationResult>> BatchWorker::submit(std::vector<GenerationRequest> sequences) {
  auto promises = std::make_shared<std::vector<std::promise<GenerationResult>>>(sequences.size());
  std::vector<std::future<GenerationResult>> futures;
  for (auto& p : *promises) futures.push_back(p.get_future());
  submit(std::move(sequences), [promises](size_t i, GenerationResult&& r) { (*promises)[i].set_value(std::move(r)); });
  return futures;
}

void BatchWorker::loop() {
  for (;;) {
    std::vector<std::pair<GenerationRequest, Generator::Done>> incoming;
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [&] { return !pending_.empty() || !running_ || !generator_.idle(); });
      if (!running_) break;
      incoming.swap(pending_);
    }
    for (auto& [request, done] : incoming) generator_.submit(std::move(request), std::move(done));
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
    slots_busy_ = generator_.active();
    generator_queued_ = generator_.queued();
    prefill_tokens_ = generator_.prefilled_tokens();
  }
  generator_.abort("the server is shutting down");
  std::vector<std::pair<GenerationRequest, Generator::Done>> left;
  {
    std::lock_guard lock(mutex_);
    left.swap(pending_);
  }
  for (auto& [request, done] : left) {  // unlocked: each done takes the lock to count itself
    GenerationResult r;
    r.error = "the server is shutting down";
    r.finish_reason = "error";
    done(std::move(r));
  }
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

namespace kiln::serve {

int64_t BatchWorker::slots_busy() const {
  std::lock_guard lock(mutex_);
  return slots_busy_;
}

int64_t BatchWorker::sequences_waiting() const {
  std::lock_guard lock(mutex_);
  return generator_queued_ + static_cast<int64_t>(pending_.size());
}

int64_t BatchWorker::slots() const { return generator_.decoder().slots(); }

int64_t BatchWorker::prefill_tokens() const {
  std::lock_guard lock(mutex_);
  return prefill_tokens_;
}

}  // namespace kiln::serve

// BatchWorker: the one thread that runs the model for `kiln serve`. HTTP handler threads
// hand it the sequences of a request and wait on futures; it feeds everything pending into
// its Generator between decoder steps, so sequences of concurrent requests share every
// forward (continuous batching). The queue is bounded: past max_pending sequences a
// submission is refused (the server answers 503) instead of growing without limit. The
// thread runs OpenMP loops with the count of the thread that made the worker (`--threads`).
#pragma once

#include "infer/generator.h"
#include "serve/serve_metrics.h"

#include <condition_variable>
#include <functional>
#include <future>
#include <mutex>
#include <thread>
#include <vector>

namespace kiln::serve {

class BatchWorker {
 public:
  // `metrics` (may be null; must outlive the worker) gets each sequence's token counts,
  // time to first token and inter-token latencies.
  BatchWorker(Generator& generator, int64_t max_pending, ServeMetrics* metrics = nullptr);
  ~BatchWorker();  // stop()
  BatchWorker(const BatchWorker&) = delete;
  BatchWorker& operator=(const BatchWorker&) = delete;

  // Called on the worker's thread with each sequence's index in the submission and its
  // result (also at shutdown, with an error).
  using Done = std::function<void(size_t index, GenerationResult&&)>;

  // Validates every sequence first (throws kiln::Error, nothing queued), then queues all
  // of them. Throws std::length_error when the queue is full or the worker has stopped.
  // The sequences' tokens are added to the calling thread's current_tally() as they end.
  void submit(std::vector<GenerationRequest> sequences, Done done);
  // The same, with a future per sequence.
  std::vector<std::future<GenerationResult>> submit(std::vector<GenerationRequest> sequences);
  // Finishes the current step, ends what is left with an error, joins the thread.
  void stop();

  int64_t steps() const;       // decoder steps run so far
  int64_t in_flight() const;   // sequences submitted and not yet finished
  int64_t max_batch() const;   // most sequences in the generator (running or waiting for a slot) at a step
  // As of the last step: sequences in a decode slot, and those waiting for one (in the
  // generator's queue or not yet handed to it).
  int64_t slots_busy() const;
  int64_t sequences_waiting() const;
  int64_t slots() const;       // decode slots in all
  int64_t prefill_tokens() const;  // prompt tokens the model computed (Generator::prefilled_tokens)

 private:
  void loop();

  Generator& generator_;
  const int64_t max_pending_;
  ServeMetrics* const metrics_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::vector<std::pair<GenerationRequest, Generator::Done>> pending_;
  int64_t in_flight_ = 0;  // submitted and not yet finished
  bool running_ = true;
  int64_t steps_ = 0, max_batch_ = 0, slots_busy_ = 0, generator_queued_ = 0, prefill_tokens_ = 0;
  std::thread thread_;
};

}  // namespace kiln::serve

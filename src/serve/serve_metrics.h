// What `kiln serve` counts for GET /metrics, written in Prometheus' text exposition format
// (version 0.0.4) by hand: the format is a few lines per series, and the packaged C++
// client (Debian's prometheus-cpp-dev) brings civetweb and libcurl along for what kiln
// would not use. Counters and histograms live here, updated from the handler threads and
// the model's thread; gauges are read from the server's parts when the page is written.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace kiln::serve {

// A cumulative histogram over fixed upper bounds (seconds); +Inf is implied.
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void observe(double value);
  // The series of metric `name`: NAME_bucket{le=...} (cumulative), NAME_sum, NAME_count.
  std::string render(const std::string& name) const;

 private:
  const std::vector<double> bounds_;
  mutable std::mutex mutex_;
  std::vector<uint64_t> counts_;  // per bucket, not cumulative; the last is +Inf's
  double sum_ = 0;
  uint64_t count_ = 0;
};

// Read from the server's parts when /metrics is asked.
struct ServeGauges {
  int64_t requests_waiting = 0;   // complete requests waiting for a handler thread
  int64_t requests_running = 0;   // requests a handler thread is answering
  int64_t sequences_waiting = 0;  // sequences submitted and not yet in a decode slot
  int64_t slots_busy = 0;         // decode slots holding a sequence
  int64_t slots = 0;              // decode slots in all
  // Prompt tokens the model computed (a counter kept by the model's thread): a prompt
  // shared by n choices counts once, where kiln_prompt_tokens_total counts it per sequence.
  int64_t prefill_tokens = 0;
};

class ServeMetrics {
 public:
  ServeMetrics();

  // One answered request. `endpoint` is a route ("/v1/completions", "/v1/models/{id}"),
  // never a client's raw path, so the series stay few whatever clients ask for.
  void request(const std::string& endpoint, int status);
  // One sequence's end: its prompt and generated token counts.
  void sequence(int64_t prompt_tokens, int64_t generated_tokens);
  void time_to_first_token(double seconds) { ttft_.observe(seconds); }
  void inter_token_latency(double seconds) { itl_.observe(seconds); }

  std::string render(const ServeGauges& gauges) const;

 private:
  mutable std::mutex mutex_;
  std::map<std::pair<std::string, int>, uint64_t> requests_;
  uint64_t prompt_tokens_ = 0, generated_tokens_ = 0, sequences_ = 0;
  Histogram ttft_, itl_;
};

}  // namespace kiln::serve

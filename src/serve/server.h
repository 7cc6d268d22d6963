// `kiln serve`: an HTTP server (cpp-httplib) with an OpenAI-compatible completions
// endpoint for evaluation harnesses, on loopback unless told otherwise.
//   POST /v1/completions   serve/completion_api.h
//   POST /tokenize, /detokenize
//   GET  /v1/models, /health
// Every answer is JSON. Client mistakes (malformed JSON, unknown or ill-typed fields,
// prompts past the context, too many prompts) are 4xx with {"error": {"message", ...}}
// (an unknown path 404, a known one asked with the other method 405 with Allow);
// a body over the size limit is 413; a full queue 503; nothing a client sends can stop
// the server. Handler threads parse and validate, then wait on the batching worker.
#pragma once

#include "serve/batch_worker.h"
#include "serve/completion_api.h"

#include <atomic>
#include <map>
#include <memory>
#include <string>

namespace httplib {
class Server;
}

namespace kiln::serve {

struct ServeOptions {
  std::string host = "127.0.0.1";
  int port = 8000;                          // 0 = an ephemeral port (see bound_port())
  std::string model_name = "kiln";
  int64_t threads = 8;                      // HTTP handler threads
  int64_t max_pending = 4096;               // sequences queued or running
  size_t max_body_bytes = size_t(16) << 20;
  int64_t read_timeout_s = 30;
  ApiLimits limits;                         // context and vocab are filled from the model
};

class CompletionServer {
 public:
  // The generator (and its decoder and model) and the tokenizer must outlive the server.
  CompletionServer(Generator& generator, const Tokenizer& tokenizer, const ServeOptions& options);
  ~CompletionServer();
  CompletionServer(const CompletionServer&) = delete;
  CompletionServer& operator=(const CompletionServer&) = delete;

  // Binds host:port; returns the port. Throws kiln::Error if it cannot.
  int bind();
  // Serves until stop() (from another thread or a signal thread).
  void listen();
  void stop();
  int bound_port() const { return port_; }
  const BatchWorker& worker() const { return *worker_; }

 private:
  void routes();

  const Tokenizer& tokenizer_;
  ServeOptions options_;
  std::unique_ptr<BatchWorker> worker_;
  std::unique_ptr<httplib::Server> http_;
  std::map<std::string, std::string> methods_;  // path -> the method it answers (routes())
  std::atomic<uint64_t> requests_{0};
  int port_ = -1;
};

}  // namespace kiln::serve

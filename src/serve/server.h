// `kiln serve`: an OpenAI-compatible completions endpoint for evaluation harnesses, on
// loopback unless told otherwise.
//   POST /v1/completions   serve/completion_api.h; "stream": true as server-sent events
//                          (serve/event_stream.h, serve/completion_stream.h)
//   POST /v1/chat/completions  serve/chat_api.h: the messages rendered by the model's chat
//                          template, then the same path; streamed chunks serve/chat_stream.h
//   POST /tokenize, /detokenize
//   GET  /v1/models, /v1/models/{id}, /health
//   GET  /metrics          Prometheus text format (serve/serve_metrics.h)
// Every answer is JSON. Client mistakes (malformed JSON, unknown or ill-typed fields,
// prompts past the context, too many prompts) are 4xx with {"error": {"message", ...}}
// (an unknown path 404, a known one asked with the other method 405 with Allow); a body
// over the size limit is 413 and an invalid Content-Length 400, both before the body is
// read; a head over 64 KiB 431; /tokenize text or /detokenize ids past ApiLimits' bounds
// 413; a request not received whole within request_timeout 408; a full queue 503 with
// Retry-After; a missing or wrong API key (when one is set) 401; nothing a client sends
// can stop the server.
//
// The pieces, front to back: ListenSocket (kiln's own exclusive socket), RequestIntake
// (one thread reading whole requests, answering /health), WorkerPool (handler threads,
// bounded queue), httplib (parsing, routing, writing the answer, on a RequestStream), and
// BatchWorker (the model, batching the sequences of all requests).
#pragma once

#include "serve/batch_worker.h"
#include "serve/chat_template.h"
#include "serve/completion_api.h"
#include "serve/listen_socket.h"
#include "serve/request_intake.h"
#include "serve/serve_metrics.h"
#include "serve/worker_pool.h"

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

namespace httplib {
struct Request;
struct Response;
}  // namespace httplib

namespace kiln::serve {

class HttpRouter;
struct RequestTally;

struct ServeOptions {
  std::string host = "127.0.0.1";
  int port = 8000;                          // 0 = any free port (see bound_port()); at most 65535
  std::string model_name = "kiln";         // `kiln serve` sets the model folder's name unless told
  // A request's `model` may also be one of these (404 model_not_found for any other):
  // "kiln" was the name every kiln server answered to, and clients configured with it go on.
  std::vector<std::string> model_aliases = {"kiln"};
  std::string api_key;                      // when set, all but /health need "Authorization: Bearer KEY"
  int64_t threads = 8;                      // HTTP handler threads
  int64_t queue = 256;                      // complete requests waiting for a handler before 503
  int64_t max_connections = 512;            // open at once; more are answered 503
  int64_t max_pending = 4096;               // sequences queued or running
  size_t max_body_bytes = size_t(16) << 20;
  size_t max_buffered_bytes = size_t(256) << 20;  // request bodies held at once (at least one max body); more are 503
  double request_timeout_s = 10;            // to receive one whole request: line, headers and body
  double write_timeout_s = 30;              // to send one whole answer
  double keep_alive_timeout_s = 5;          // an idle connection between requests
  // After stop(): how long requests in progress (and queued for a handler) may take to
  // finish before their sequences are ended with an error.
  double shutdown_grace_s = 30;
  bool access_log = false;                  // a line per answered request on stderr (serve/access_log.h)
  ApiLimits limits;                         // context and vocab are filled from the model
  // Renders /v1/chat/completions' messages (ChatTemplate::for_model); null: kiln's default.
  std::shared_ptr<const ChatTemplate> chat_template;
};

class CompletionServer {
 public:
  // The generator (and its decoder and model) and the tokenizer must outlive the server.
  CompletionServer(Generator& generator, const Tokenizer& tokenizer, const ServeOptions& options);
  ~CompletionServer();
  CompletionServer(const CompletionServer&) = delete;
  CompletionServer& operator=(const CompletionServer&) = delete;

  // Binds host:port (exclusively: a second server on the port fails here); returns the
  // port. Throws kiln::Error naming host and port if it cannot.
  int bind();
  // Serves until stop() (from another thread or a signal thread). Then: no new connection
  // is accepted (the listening socket closes), and requests in progress or queued finish
  // within shutdown_grace_s; past it their sequences end with an error. Returns how many
  // requests were cut off so (0 when all finished).
  int64_t listen();
  void stop();
  // stop(), and cut off what is in progress now rather than at the grace bound.
  void stop_now();
  int bound_port() const { return socket_ ? socket_->port() : -1; }
  const BatchWorker& worker() const { return *worker_; }
  const WorkerPool& handlers() const { return *pool_; }

 private:
  void routes();
  // Answers a parsed completion or chat request: unstreamed, or streamed in its API's chunks.
  enum class Api { completions, chat };
  void generate(Api api, CompletionRequest& request, uint64_t n, const httplib::Request& req, httplib::Response& res);
  void handle(ReadyRequest& request);
  std::string endpoint(const std::string& path) const;  // the metrics' label for a request path
  void answered(const std::string& method, const std::string& path, int status,
                std::chrono::steady_clock::time_point started, const RequestTally* tally);
  std::vector<std::string> served_names() const;
  void warn_ignored(const std::vector<std::string>& fields);

  const Tokenizer& tokenizer_;
  ServeOptions options_;
  ServeMetrics metrics_;  // before worker_, which reports to it
  std::unique_ptr<BatchWorker> worker_;
  std::unique_ptr<HttpRouter> http_;
  std::map<std::string, std::string> methods_;  // path -> the method it answers (routes())
  std::mutex warned_mutex_;
  std::set<std::string> warned_;  // ignored request fields logged already (once each)
  std::atomic<uint64_t> requests_{0};
  std::atomic<bool> stopping_{false}, cut_now_{false};
  std::unique_ptr<ListenSocket> socket_;
  std::unique_ptr<RequestIntake> intake_;
  std::unique_ptr<WorkerPool> pool_;  // last: destroyed first, its threads joined before the rest goes
};

}  // namespace kiln::serve

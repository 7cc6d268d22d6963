#include "serve/server.h"

#include "serve/access_log.h"
#include "serve/api_key.h"
#include "serve/chat_api.h"
#include "serve/chat_stream.h"
#include "serve/completion_stream.h"
#include "serve/event_stream.h"
#include "serve/request_stream.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <httplib.h>

#include <algorithm>
#include <chrono>
#include <thread>

namespace kiln::serve {

using nlohmann::json;

// httplib's request parsing, routing and answer writing, run on a stream kiln gives it:
// httplib 0.11 keeps process_request protected for subclasses, which is its one way to
// serve a connection it did not accept itself.
class HttpRouter final : public httplib::Server {
 public:
  using httplib::Server::process_request;
};

namespace {

constexpr int64_t kRequestsPerConnection = 1000;  // then the connection closes (Keep-Alive max)

// The status httplib answered the request on this handler thread with (its logger's
// report); 0 when it wrote none.
thread_local int answered_status = 0;

std::chrono::milliseconds milliseconds(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

void reply(httplib::Response& res, int status, const json& body) {
  res.status = status;
  // Replace invalid UTF-8 (a byte-level model can stop mid-character) instead of throwing.
  res.set_content(body.dump(-1, ' ', false, json::error_handler_t::replace), "application/json");
}

void reply_error(httplib::Response& res, int status, const std::string& message, const std::string& param = "",
                 const std::string& code = "") {
  reply(res, status, error_body(status, message, param, code));
}

json parse_body(const httplib::Request& req) {
  try {
    return json::parse(req.body);
  } catch (const json::exception& e) {
    throw ApiError(400, fmt::format("malformed JSON body: {}", e.what()));
  }
}

// A body of at most `max_values` JSON values (numbers, strings, arrays, objects, at any
// depth), else `too_many` from the value past it. Parsed, every value takes 16 bytes and
// more, so a body of small numbers ("[0,0,0,..." at 2 bytes a value) holds eight times its
// size and more before a field is looked at: a 16 MiB /detokenize body held 350 MB.
json parse_body(const httplib::Request& req, size_t max_values, const ApiError& too_many) {
  size_t values = 0;
  const json::parser_callback_t count = [&](int, json::parse_event_t event, json&) {
    if (event == json::parse_event_t::value || event == json::parse_event_t::array_start ||
        event == json::parse_event_t::object_start)
      if (++values > max_values) throw too_many;
    return true;
  };
  try {
    return json::parse(req.body, count);
  } catch (const json::exception& e) {
    throw ApiError(400, fmt::format("malformed JSON body: {}", e.what()));
  }
}

// Runs a handler body, turning every failure into a JSON error response.
template <typename Fn>
void guarded(httplib::Response& res, Fn&& fn) {
  try {
    fn();
  } catch (const ApiError& e) {
    reply_error(res, e.status, e.what(), e.param, e.code);
  } catch (const Error& e) {  // kiln validation (prompt limits, ids, sampling values)
    reply_error(res, 400, e.what());
  } catch (const std::length_error& e) {
    res.set_header("Retry-After", "1");
    reply_error(res, 503, e.what());
  } catch (const std::exception& e) {
    reply_error(res, 500, fmt::format("internal error: {}", e.what()));
  }
}

}  // namespace

CompletionServer::CompletionServer(Generator& generator, const Tokenizer& tokenizer, const ServeOptions& options)
    : tokenizer_(tokenizer), options_(options), http_(std::make_unique<HttpRouter>()) {
  KILN_CHECK(options_.threads >= 1 && options_.queue >= 1 && options_.max_connections >= 1, "serve",
             "threads, queue and max_connections must be at least 1 (got {}, {}, {})", options_.threads,
             options_.queue, options_.max_connections);
  KILN_CHECK(options_.max_body_bytes >= 1 && options_.request_timeout_s > 0 && options_.write_timeout_s > 0 &&
                 options_.keep_alive_timeout_s > 0,
             "serve", "max_body_bytes and the timeouts must be positive");
  options_.limits.context = generator.decoder().max_len();
  options_.limits.vocab = std::min<int64_t>(generator.decoder().vocab_size(), tokenizer.vocab_size());
  options_.limits.slots = generator.decoder().slots();
  options_.limits.max_sequences = options_.max_pending;
  worker_ = std::make_unique<BatchWorker>(generator, options_.max_pending, &metrics_);
  if (!options_.chat_template) options_.chat_template = std::make_shared<const ChatTemplate>(ChatTemplate::kiln_default());
  http_->set_payload_max_length(options_.max_body_bytes);  // RequestIntake enforces it first
  http_->set_keep_alive_max_count(kRequestsPerConnection);
  http_->set_keep_alive_timeout(static_cast<time_t>(std::max(1.0, options_.keep_alive_timeout_s)));
  routes();
  pool_ = std::make_unique<WorkerPool>(static_cast<size_t>(options_.threads), static_cast<size_t>(options_.queue));
}

CompletionServer::~CompletionServer() {
  stop();
  pool_->shutdown();
  worker_->stop();
}

void CompletionServer::routes() {
  // Each path answers one method; methods_ remembers which, for the 405 answers below.
  auto post = [this](const std::string& path, httplib::Server::Handler handler) {
    methods_[path] = "POST";
    http_->Post(path, std::move(handler));
  };
  auto get = [this](const std::string& path, httplib::Server::Handler handler) {
    methods_[path] = "GET";
    http_->Get(path, std::move(handler));
  };
  post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) {
    guarded(res, [&] {
      const uint64_t n = requests_.fetch_add(1);
      const json body = parse_body(req);
      check_model(body, served_names());
      CompletionRequest request = parse_completion_request(body, tokenizer_, options_.limits, n * 1000003 + 17);
      generate(Api::completions, request, n, req, res);
    });
  });
  post("/v1/chat/completions", [this](const httplib::Request& req, httplib::Response& res) {
    guarded(res, [&] {
      const uint64_t n = requests_.fetch_add(1);
      const json body = parse_body(req);
      check_model(body, served_names());
      CompletionRequest request =
          parse_chat_request(body, tokenizer_, *options_.chat_template, options_.limits, n * 1000003 + 17);
      generate(Api::chat, request, n, req, res);
    });
  });
  post("/tokenize", [this](const httplib::Request& req, httplib::Response& res) {
    guarded(res, [&] {
      res.status = 200;
      res.set_content(tokenize_response(parse_body(req), tokenizer_, options_.limits), "application/json");
    });
  });
  post("/detokenize", [this](const httplib::Request& req, httplib::Response& res) {
    guarded(res, [&] {
      // The ids, the body's object and its two other members (model and the array itself).
      const auto max_values = static_cast<size_t>(options_.limits.max_detokenize_ids) + 3;
      const json body = parse_body(req, max_values, too_many_detokenize_ids(options_.limits));
      reply(res, 200, detokenize_response(body, tokenizer_, options_.limits));
    });
  });
  auto model_object = [this](const std::string& id) {
    return json{{"id", id}, {"object", "model"}, {"created", 0}, {"owned_by", "kiln"},
                {"max_model_len", options_.limits.context}};
  };
  get("/v1/models", [this, model_object](const httplib::Request&, httplib::Response& res) {
    reply(res, 200, {{"object", "list"}, {"data", json::array({model_object(options_.model_name)})}});
  });
  // An id may hold slashes ("org/name"), so the rest of the path is the id.
  http_->Get(R"(/v1/models/(.+))", [this, model_object](const httplib::Request& req, httplib::Response& res) {
    guarded(res, [&] {
      const std::string id = req.matches[1];
      const std::vector<std::string> served = served_names();
      if (std::find(served.begin(), served.end(), id) == served.end()) throw model_not_found(id, served.front());
      reply(res, 200, model_object(id));
    });
  });
  get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    ServeGauges g;
    g.requests_waiting = static_cast<int64_t>(pool_->queued());
    g.requests_running = static_cast<int64_t>(pool_->busy());  // this one among them
    g.sequences_waiting = worker_->sequences_waiting();
    g.slots_busy = worker_->slots_busy();
    g.slots = worker_->slots();
    g.prefill_tokens = worker_->prefill_tokens();
    res.status = 200;
    res.set_content(metrics_.render(g), "text/plain; version=0.0.4; charset=utf-8");
  });
  // GET /health is answered by RequestIntake before a request reaches a handler; this route
  // is what the 405 answers below know it by.
  get("/health", [](const httplib::Request&, httplib::Response& res) { reply(res, 200, {{"status", "ok"}}); });
  http_->set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (options_.api_key.empty() || req.path == "/health") return httplib::Server::HandlerResponse::Unhandled;
    const std::string authorization = req.get_header_value("Authorization");
    if (bearer_matches(authorization, options_.api_key)) return httplib::Server::HandlerResponse::Unhandled;
    json body = error_body(401, authorization.empty()
                                    ? "no API key: send it as the header 'Authorization: Bearer <key>'"
                                    : "incorrect API key");
    body["error"]["code"] = "invalid_api_key";
    res.set_header("WWW-Authenticate", "Bearer");
    reply(res, 401, body);
    return httplib::Server::HandlerResponse::Handled;
  });
  http_->set_logger([](const httplib::Request&, const httplib::Response& res) { answered_status = res.status; });
  http_->set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr) {
    reply_error(res, 500, "internal error");
  });
  http_->set_error_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (res.body.empty() && res.status == 404) {
      if (auto it = methods_.find(req.path); it != methods_.end()) {
        res.set_header("Allow", it->second);
        reply_error(res, 405, fmt::format("{} takes {} requests, not {}", req.path, it->second, req.method));
        return;
      }
    }
    if (res.body.empty()) {
      const std::string message = res.status == 404   ? fmt::format("no route {} {}", req.method, req.path)
                                  : res.status == 413 ? (req.get_header_value("Content-Type").find("json") == std::string::npos
                                                             ? "the request body is too large (send it as application/json:"
                                                               " form-encoded bodies are limited to 8 KiB)"
                                                             : "the request body is too large")
                                                      : fmt::format("HTTP {}", res.status);
      reply_error(res, res.status, message);
    }
  });
}

void CompletionServer::generate(Api api, CompletionRequest& request, uint64_t n, const httplib::Request& req,
                                httplib::Response& res) {
  warn_ignored(request.ignored_fields);
  const std::string id = fmt::format("{}-kiln-{}", api == Api::chat ? "chatcmpl" : "cmpl", n);
  const auto created =
      std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
  if (request.stream) {
    RequestStream& stream = *RequestStream::current();
    EventStreamOptions o;
    o.chunked = req.version == "HTTP/1.1";  // chunked framing is HTTP/1.1's
    o.close = stream.close();
    o.include_usage = request.include_usage;
    std::unique_ptr<ChunkFormat> format;
    if (api == Api::chat) format = std::make_unique<ChatChunks>(request, tokenizer_, id, options_.model_name, created);
    else format = std::make_unique<CompletionChunks>(request, tokenizer_, id, options_.model_name, created);
    stream_generation(stream, *worker_, std::move(request.sequences), *format, o);
    return;
  }
  std::vector<std::future<GenerationResult>> futures = worker_->submit(request.sequences);
  std::vector<GenerationResult> results;
  for (auto& f : futures) results.push_back(f.get());
  for (const GenerationResult& r : results)
    if (!r.error.empty()) throw std::runtime_error(r.error);
  reply(res, 200, api == Api::chat
                      ? chat_completion_response(request, results, tokenizer_, options_.model_name, id, created)
                      : completion_response(request, results, tokenizer_, options_.model_name, id, created));
}

std::vector<std::string> CompletionServer::served_names() const {
  std::vector<std::string> names = {options_.model_name};
  for (const std::string& alias : options_.model_aliases)
    if (alias != options_.model_name) names.push_back(alias);
  return names;
}

// Once per field name for the server's life: a client sends the same fields with every
// request, and a line per request would bury the log.
void CompletionServer::warn_ignored(const std::vector<std::string>& fields) {
  std::vector<std::string> fresh;
  {
    std::lock_guard lock(warned_mutex_);
    for (const std::string& f : fields)
      if (warned_.insert(f).second) fresh.push_back(f);
  }
  if (!fresh.empty())
    warn("serve", fmt::format("ignoring request field{} '{}' (not used by kiln; logged once)",
                              fresh.size() > 1 ? "s" : "", fmt::join(fresh, "', '")));
}

int CompletionServer::bind() {
  KILN_CHECK(!socket_, "serve", "bind() twice");
  socket_ = std::make_unique<ListenSocket>(options_.host, options_.port);
  IntakeOptions intake;
  intake.max_body_bytes = options_.max_body_bytes;
  intake.max_buffered_bytes = std::max(options_.max_buffered_bytes, options_.max_body_bytes);
  intake.request_timeout = milliseconds(options_.request_timeout_s);
  intake.keep_alive_timeout = milliseconds(options_.keep_alive_timeout_s);
  intake.max_connections = static_cast<size_t>(options_.max_connections);
  intake.answered = [this](const RequestHead* head, int status, std::chrono::steady_clock::time_point started) {
    answered(head ? head->method : "-", head ? head->path : "-", status, started, nullptr);
  };
  intake_ = std::make_unique<RequestIntake>(socket_->fd(), intake, [this](const std::shared_ptr<ReadyRequest>& r) {
    std::function<void()> job = [this, r] { handle(*r); };
    return pool_->try_post(job);
  });
  if (stopping_) intake_->stop();
  return socket_->port();
}

int64_t CompletionServer::listen() {
  KILN_CHECK(intake_ != nullptr, "serve", "listen() before bind()");
  intake_->run();
  socket_->close();  // a client connecting now is refused at once, not left in the backlog
  const auto deadline = std::chrono::steady_clock::now() + milliseconds(options_.shutdown_grace_s);
  auto unfinished = [&] { return static_cast<int64_t>(pool_->busy() + pool_->queued()); };
  while (unfinished() > 0 && !cut_now_ && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  const int64_t cut = unfinished();
  // Past the bound: the model stops, ending every sequence with an error, so the handlers
  // answer (a stream with its error event and [DONE]) and return.
  if (cut > 0) worker_->stop();
  pool_->shutdown();
  return cut;
}

void CompletionServer::stop() {
  stopping_ = true;
  if (intake_) intake_->stop();
}

void CompletionServer::stop_now() {
  cut_now_ = true;
  stop();
}

// On a handler thread: httplib parses the request (read whole already), routes it and
// writes the answer; the connection then goes back to the intake for its next request.
void CompletionServer::handle(ReadyRequest& request) {
  Connection& connection = *request.connection;
  const bool close = !request.head.keep_alive || ++connection.served >= kRequestsPerConnection || stopping_;
  RequestStream stream(connection.fd(), std::move(request.bytes), milliseconds(options_.write_timeout_s));
  stream.set_close(close);
  bool closed_by_client = false;
  auto tally = std::make_shared<RequestTally>();
  answered_status = 0;
  bool dropped = false;
  try {
    TallyScope tallying(tally);
    RequestStream::Serving serving(stream);
    http_->process_request(stream, close, closed_by_client, nullptr);
  } catch (const std::exception&) {  // httplib catches what handlers throw; anything else drops the connection
    dropped = true;
  }
  answered(request.head.method, request.head.path, answered_status, request.started, tally.get());
  if (dropped) return;
  if (!stream.close() && !closed_by_client && !stream.write_failed()) intake_->resume(std::move(request.connection));
}

}  // namespace kiln::serve

namespace kiln::serve {

// Routes by name, "/v1/models/{id}" for any model id, "other" for any path no route has:
// a label per raw path would let clients grow the metrics without bound.
std::string CompletionServer::endpoint(const std::string& path) const {
  if (methods_.count(path)) return path;
  if (path.rfind("/v1/models/", 0) == 0) return "/v1/models/{id}";
  return "other";
}

void CompletionServer::answered(const std::string& method, const std::string& path, int status,
                                std::chrono::steady_clock::time_point started, const RequestTally* tally) {
  metrics_.request(endpoint(path), status);
  if (!options_.access_log) return;
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - started).count();
  write_access_line(access_line(method, path, status, tally ? tally->prompt_tokens.load() : 0,
                                tally ? tally->completion_tokens.load() : 0, ms));
}

}  // namespace kiln::serve

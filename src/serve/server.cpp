#include "serve/server.h"

#include <fmt/format.h>
#include <httplib.h>

#include <chrono>

namespace kiln::serve {

using nlohmann::json;

namespace {

void reply(httplib::Response& res, int status, const json& body) {
  res.status = status;
  // Replace invalid UTF-8 (a byte-level model can stop mid-character) instead of throwing.
  res.set_content(body.dump(-1, ' ', false, json::error_handler_t::replace), "application/json");
}

void reply_error(httplib::Response& res, int status, const std::string& message, const std::string& param = "") {
  reply(res, status, error_body(status, message, param));
}

json parse_body(const httplib::Request& req) {
  try {
    return json::parse(req.body);
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
    reply_error(res, e.status, e.what(), e.param);
  } catch (const Error& e) {  // kiln validation (prompt limits, ids, sampling values)
    reply_error(res, 400, e.what());
  } catch (const std::length_error& e) {
    reply_error(res, 503, e.what());
  } catch (const std::exception& e) {
    reply_error(res, 500, fmt::format("internal error: {}", e.what()));
  }
}

}  // namespace

CompletionServer::CompletionServer(Generator& generator, const Tokenizer& tokenizer, const ServeOptions& options)
    : tokenizer_(tokenizer), options_(options), http_(std::make_unique<httplib::Server>()) {
  options_.limits.context = generator.decoder().max_len();
  options_.limits.vocab = std::min<int64_t>(generator.decoder().vocab_size(), tokenizer.vocab_size());
  worker_ = std::make_unique<BatchWorker>(generator, options_.max_pending);
  const auto threads = static_cast<size_t>(std::max<int64_t>(1, options_.threads));
  http_->new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  http_->set_payload_max_length(options_.max_body_bytes);
  http_->set_read_timeout(options_.read_timeout_s, 0);
  http_->set_write_timeout(options_.read_timeout_s, 0);
  routes();
}

CompletionServer::~CompletionServer() {
  stop();
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
      const CompletionRequest request = parse_completion_request(body, tokenizer_, options_.limits, n * 1000003 + 17);
      std::vector<std::future<GenerationResult>> futures = worker_->submit(request.sequences);
      std::vector<GenerationResult> results;
      for (auto& f : futures) results.push_back(f.get());
      for (const GenerationResult& r : results)
        if (!r.error.empty()) throw std::runtime_error(r.error);
      const auto created = std::chrono::duration_cast<std::chrono::seconds>(
                               std::chrono::system_clock::now().time_since_epoch())
                               .count();
      reply(res, 200,
            completion_response(request, results, tokenizer_, options_.model_name, fmt::format("cmpl-kiln-{}", n),
                                created));
    });
  });
  post("/tokenize", [this](const httplib::Request& req, httplib::Response& res) {
    guarded(res, [&] { reply(res, 200, tokenize_response(parse_body(req), tokenizer_, options_.limits)); });
  });
  post("/detokenize", [this](const httplib::Request& req, httplib::Response& res) {
    guarded(res, [&] { reply(res, 200, detokenize_response(parse_body(req), tokenizer_, options_.limits)); });
  });
  get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
    json model = {{"id", options_.model_name}, {"object", "model"}, {"owned_by", "kiln"},
                  {"max_model_len", options_.limits.context}};
    reply(res, 200, {{"object", "list"}, {"data", json::array({model})}});
  });
  get("/health", [](const httplib::Request&, httplib::Response& res) { reply(res, 200, {{"status", "ok"}}); });
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

int CompletionServer::bind() {
  const int port = options_.port == 0 ? http_->bind_to_any_port(options_.host)
                                      : (http_->bind_to_port(options_.host, options_.port) ? options_.port : -1);
  KILN_CHECK(port > 0, "serve", "cannot listen on {}:{}", options_.host, options_.port);
  port_ = port;
  return port;
}

void CompletionServer::listen() {
  KILN_CHECK(port_ > 0, "serve", "listen() before bind()");
  http_->listen_after_bind();
}

void CompletionServer::stop() {
  if (http_->is_running()) http_->stop();
}

}  // namespace kiln::serve

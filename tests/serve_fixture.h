// Shared by the serve suites: a tiny random model served in-process on 127.0.0.1 (an
// ephemeral port), and a raw TCP client for what httplib's client will not send (bad
// lengths, a request a line at a time) with every wait bounded by a deadline.
#pragma once

#include "export_fixture.h"
#include "infer/generator.h"
#include "serve/server.h"

#include <gtest/gtest.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include <arpa/inet.h>
#include <chrono>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <optional>
#include <poll.h>
#include <string>
#include <sys/socket.h>
#include <thread>
#include <unistd.h>

namespace kiln::test {

using Clock = std::chrono::steady_clock;

inline Clock::time_point after(double seconds) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

inline double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// A model, a generator and a CompletionServer listening on a thread. `tokenizer` is the
// one the server and the generator use (a test may pass one that misbehaves on purpose).
class ServedModel {
 public:
  ServedModel(const Tokenizer& tokenizer, serve::ServeOptions options, int64_t slots = 4) {
    BuildOptions o;
    o.training = false;
    o.max_tokens = 64;
    model = std::make_unique<Model>(tiny_config(true, true, false), o);
    model->allocate();
    randomize_weights(*model, 9);
    DecoderOptions d;
    d.slots = slots;
    d.max_rows = 32;
    decoder = std::make_unique<Decoder>(*model, d);
    generator = std::make_unique<Generator>(*decoder, tokenizer);
    options.port = 0;
    server = std::make_unique<serve::CompletionServer>(*generator, tokenizer, options);
    port = server->bind();
    thread = std::thread([this] { server->listen(); });
  }
  ~ServedModel() {
    server->stop();
    thread.join();
  }
  httplib::Client client(int read_timeout_s = 120) const {
    httplib::Client c("127.0.0.1", port);
    c.set_connection_timeout(5, 0);
    c.set_read_timeout(read_timeout_s, 0);
    return c;
  }

  std::unique_ptr<Model> model;
  std::unique_ptr<Decoder> decoder;
  std::unique_ptr<Generator> generator;
  std::unique_ptr<serve::CompletionServer> server;
  std::thread thread;
  int port = 0;
};

struct RawResponse {
  int status = 0;
  std::string head, body;
};

// One TCP connection to 127.0.0.1:port.
class RawConnection {
 public:
  explicit RawConnection(int port) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = ::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    const int yes = 1;
    setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &yes, sizeof(yes));
  }
  ~RawConnection() { ::close(fd_); }
  RawConnection(const RawConnection&) = delete;
  RawConnection& operator=(const RawConnection&) = delete;

  bool connected() const { return connected_; }
  // False once the server has closed (or reset) the connection.
  bool send(const std::string& bytes) {
    return connected_ && ::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(bytes.size());
  }
  // One whole response (head and Content-Length body), or nullopt if none came within
  // `seconds` or the connection closed first.
  std::optional<RawResponse> read_response(double seconds) {
    const auto deadline = after(seconds);
    for (;;) {
      const size_t end = buffer_.find("\r\n\r\n");
      if (end != std::string::npos) {
        RawResponse r;
        r.head = buffer_.substr(0, end + 4);
        r.status = std::atoi(r.head.c_str() + 9);
        size_t length = 0;
        if (const size_t at = lower(r.head).find("content-length:"); at != std::string::npos)
          length = std::stoul(r.head.substr(at + 15));
        if (buffer_.size() >= end + 4 + length) {
          r.body = buffer_.substr(end + 4, length);
          buffer_.erase(0, end + 4 + length);
          if (r.status == 100) continue;  // an interim answer: the real one follows
          return r;
        }
      }
      if (!fill(deadline)) return std::nullopt;
    }
  }
  // True once the bytes received (not taken by read_response yet) hold `text`, within `seconds`.
  bool received(const std::string& text, double seconds) {
    const auto deadline = after(seconds);
    while (buffer_.find(text) == std::string::npos)
      if (!fill(deadline)) return false;
    return true;
  }
  // The bytes received up to and including the first `text`, taken from the buffer, or
  // nullopt if `text` did not come within `seconds`.
  std::optional<std::string> read_through(const std::string& text, double seconds) {
    if (!received(text, seconds)) return std::nullopt;
    const size_t end = buffer_.find(text) + text.size();
    std::string out = buffer_.substr(0, end);
    buffer_.erase(0, end);
    return out;
  }
  // True when the server closes the connection within `seconds` (what it sent is dropped).
  bool closed_within(double seconds) {
    const auto deadline = after(seconds);
    while (fill(deadline)) buffer_.clear();
    return eof_;
  }

 private:
  static std::string lower(std::string s) {
    for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return s;
  }
  // Reads what arrives before `deadline`; false at the deadline or at the end of the stream.
  bool fill(Clock::time_point deadline) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    pollfd p{fd_, POLLIN, 0};
    if (left <= 0 || ::poll(&p, 1, static_cast<int>(left)) <= 0) return false;
    char chunk[8192];
    const ssize_t n = ::recv(fd_, chunk, sizeof(chunk), 0);
    if (n <= 0) {
      eof_ = true;
      return false;
    }
    buffer_.append(chunk, static_cast<size_t>(n));
    return true;
  }

  int fd_ = -1;
  bool connected_ = false;
  bool eof_ = false;
  std::string buffer_;
};

// A complete HTTP/1.1 request.
inline std::string http_request(const std::string& method, const std::string& path, const std::string& body = "",
                                const std::string& extra_headers = "") {
  return method + " " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\n" + extra_headers +
         (body.empty() && method == "GET" ? "" : "Content-Length: " + std::to_string(body.size()) + "\r\n") +
         "\r\n" + body;
}

// The events of a chunked event-stream answer (its head checked), through [DONE].
inline std::vector<std::string> read_events(RawConnection& c, std::string* head = nullptr) {
  const std::optional<std::string> bytes = c.read_through("\r\n0\r\n\r\n", 60);
  if (!bytes) return {};
  const size_t body = bytes->find("\r\n\r\n") + 4;
  if (head) *head = bytes->substr(0, body);
  std::string events;
  for (size_t at = body; at < bytes->size();) {  // de-chunk
    const size_t line = bytes->find("\r\n", at);
    const size_t n = std::stoul(bytes->substr(at, line - at), nullptr, 16);
    events += bytes->substr(line + 2, n);
    at = line + 2 + n + 2;
  }
  std::vector<std::string> out;
  for (size_t at = 0; at < events.size();) {
    const size_t end = events.find("\n\n", at);
    EXPECT_EQ(events.compare(at, 6, "data: "), 0) << events;
    out.push_back(events.substr(at + 6, end - at - 6));
    at = end + 2;
  }
  return out;
}

// GET /health answered 200 within `seconds` (a fresh connection each try, retried until
// the deadline: the first try may race a connection the kernel has not accepted yet).
inline bool health_answers(int port, double seconds) {
  const auto deadline = after(seconds);
  while (Clock::now() < deadline) {
    RawConnection c(port);
    if (c.send(http_request("GET", "/health"))) {
      const double left = std::chrono::duration<double>(deadline - Clock::now()).count();
      const std::optional<RawResponse> r = c.read_response(std::max(0.05, left));
      if (r && r->status == 200) return true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

// A model (served as "slow", its folder's name) whose stream of 2000 tokens takes seconds of
// the model's time on one thread, so a client or signal acting after the first event finds
// the stream in progress.
inline std::string slow_streaming_model(const std::string& root) {
  ModelConfig config = tiny_config(true, true, false, 256);
  config.heads = 4;
  config.kv_heads = 2;
  config.head_dim = 64;
  config.layers = 4;
  config.ffn_hidden = 1024;
  config.max_seq_len = 2048;
  return save_random_model(config, root + "/slow");
}

}  // namespace kiln::test

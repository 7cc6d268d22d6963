// The front of `kiln serve`: one thread that accepts connections and, with poll(), reads
// each request whole (head and body) within one deadline before a handler thread sees it.
// httplib 0.11 reads each request on a pool thread with only a per-read timeout, so eight
// clients sending a header line every few seconds held all eight threads and the server
// (/health included) stopped answering. Here a slow client costs a file descriptor, never
// a thread, and is answered 408 at its deadline; /health is answered on this thread, so it
// answers while every handler is busy; a bad or oversized Content-Length is answered from
// the head alone, before a body byte is read; a request no handler can take (the queue is
// full) is answered 503 with Retry-After at once.
#pragma once

#include "serve/request_head.h"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace kiln::serve {

struct IntakeOptions {
  uint64_t max_body_bytes = uint64_t(16) << 20;
  uint64_t max_buffered_bytes = uint64_t(256) << 20;   // request bodies held at once; more are 503
  std::chrono::milliseconds request_timeout{10000};    // a request's first byte to its last
  std::chrono::milliseconds keep_alive_timeout{5000};  // a connection idle between requests
  size_t max_connections = 512;                        // open at once; more are answered 503
  // Called on the intake's thread for each request it answers itself (GET /health, and
  // 408, 413, 431, 503 refusals): its head (null when none was read whole), the status,
  // and when its first byte came. For the access log and the metrics.
  std::function<void(const RequestHead* head, int status, std::chrono::steady_clock::time_point started)> answered;
};

// One client connection; closing its socket when destroyed.
class Connection {
 public:
  Connection(int fd, std::atomic<size_t>& open_count);
  ~Connection();
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;
  int fd() const { return fd_; }

  std::string buffer;   // bytes received and not yet taken as a request
  int64_t served = 0;   // requests answered on it

 private:
  const int fd_;
  std::atomic<size_t>& open_count_;
};

// A share of IntakeOptions::max_buffered_bytes, taken when a head announces its body and
// given back when the request is done with (moved along with it to the handler).
class BodyReservation {
 public:
  BodyReservation() = default;
  BodyReservation(std::atomic<uint64_t>& held, uint64_t bytes) : held_(&held), bytes_(bytes) { held += bytes; }
  BodyReservation(BodyReservation&& other) noexcept { *this = std::move(other); }
  BodyReservation& operator=(BodyReservation&& other) noexcept {
    release();
    held_ = std::exchange(other.held_, nullptr);
    bytes_ = other.bytes_;
    return *this;
  }
  ~BodyReservation() { release(); }

 private:
  void release() {
    if (held_) *held_ -= bytes_;
    held_ = nullptr;
  }
  std::atomic<uint64_t>* held_ = nullptr;
  uint64_t bytes_ = 0;
};

// A complete request, handed to a handler thread with its connection.
struct ReadyRequest {
  std::unique_ptr<Connection> connection;
  RequestHead head;
  std::chrono::steady_clock::time_point started;  // its first byte came
  std::string bytes;  // exactly the request: its head (less any Expect: 100-continue) and body
  BodyReservation body;
};

class RequestIntake {
 public:
  // Called on the intake's thread with each complete request other than GET /health;
  // false when no handler can take it (the intake then answers 503).
  using Dispatch = std::function<bool(const std::shared_ptr<ReadyRequest>&)>;

  RequestIntake(int listen_fd, const IntakeOptions& options, Dispatch dispatch);
  ~RequestIntake();
  RequestIntake(const RequestIntake&) = delete;
  RequestIntake& operator=(const RequestIntake&) = delete;

  // Accepts and reads until stop(); closes every connection it holds when it returns.
  void run();
  // From any thread (a signal handler's thread included); run() returns soon after.
  void stop();
  // A handler has answered on `connection`, which stays open: read its next request.
  void resume(std::unique_ptr<Connection> connection);

 private:
  enum class Phase { idle, reading, closing };
  struct Held {
    Held(std::unique_ptr<Connection> c, Phase p, std::chrono::steady_clock::time_point d)
        : connection(std::move(c)), phase(p), deadline(d) {}
    std::unique_ptr<Connection> connection;  // null once handed on or closed
    Phase phase;
    std::chrono::steady_clock::time_point deadline;
    std::chrono::steady_clock::time_point started = std::chrono::steady_clock::now();  // the request's first byte
    size_t scanned = 0;       // buffer bytes searched for the end of the head
    std::optional<RequestHead> head;
    BodyReservation body;     // once the head is in
    bool continue_sent = false;
  };

  void accept_new();
  void read_from(Held& h);
  void advance(Held& h);
  void answer_and_close(Held& h, int status, const std::string& message, const char* extra_headers = "");
  void expire();
  void take_resumed();
  void wake();

  const int listen_fd_;
  const IntakeOptions options_;
  const Dispatch dispatch_;
  const int wake_fd_;
  std::atomic<bool> stopping_{false};
  std::atomic<size_t> open_count_{0};
  std::atomic<uint64_t> buffered_bytes_{0};  // bodies announced and not yet done with
  std::list<Held> held_;  // a list: advance() adds (a refused request) while others are visited
  std::chrono::steady_clock::time_point accept_paused_until_{};
  std::mutex resumed_mutex_;
  std::vector<std::unique_ptr<Connection>> resumed_;
};

}  // namespace kiln::serve

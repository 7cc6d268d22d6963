#include "serve/request_intake.h"

#include "serve/completion_api.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

namespace kiln::serve {

namespace {

using Clock = std::chrono::steady_clock;

constexpr size_t kMaxHeadBytes = 64 * 1024;                 // request line and headers
constexpr auto kLingerTime = std::chrono::milliseconds(2000);  // draining a closed connection
constexpr auto kAcceptPause = std::chrono::milliseconds(100);  // after running out of descriptors
constexpr int kAcceptsPerTurn = 256;                           // so reads are not starved by a burst

const char* reason(int status) {
  switch (status) {
    case 200: return "OK";
    case 400: return "Bad Request";
    case 408: return "Request Timeout";
    case 413: return "Payload Too Large";
    case 431: return "Request Header Fields Too Large";
    case 501: return "Not Implemented";
    case 503: return "Service Unavailable";
    default: return "Error";
  }
}

std::string response(int status, const std::string& body, bool close, const char* extra_headers = "") {
  return fmt::format("HTTP/1.1 {} {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n{}{}\r\n{}", status,
                     reason(status), body.size(), close ? "Connection: close\r\n" : "", extra_headers, body);
}

std::string head_too_large() {
  return fmt::format("the request head (request line and headers) is over {} bytes", kMaxHeadBytes);
}

// Writes all of `bytes` without waiting, or nothing useful: the answers sent from the
// intake are small and go into an empty socket buffer; a client that does not read them
// loses its connection rather than stalling the intake.
bool send_now(int fd, const std::string& bytes) {
  size_t sent = 0;
  while (sent < bytes.size()) {
    const ssize_t n = ::send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    sent += static_cast<size_t>(n);
  }
  return true;
}

}  // namespace

Connection::Connection(int fd, std::atomic<size_t>& open_count) : fd_(fd), open_count_(open_count) { ++open_count_; }

Connection::~Connection() {
  ::close(fd_);
  --open_count_;
}

RequestIntake::RequestIntake(int listen_fd, const IntakeOptions& options, Dispatch dispatch)
    : listen_fd_(listen_fd),
      options_(options),
      dispatch_(std::move(dispatch)),
      wake_fd_(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {}

RequestIntake::~RequestIntake() {
  held_.clear();
  resumed_.clear();
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

void RequestIntake::wake() {
  const uint64_t one = 1;
  [[maybe_unused]] const ssize_t n = ::write(wake_fd_, &one, sizeof(one));
}

void RequestIntake::stop() {
  stopping_ = true;
  wake();
}

void RequestIntake::resume(std::unique_ptr<Connection> connection) {
  {
    std::lock_guard lock(resumed_mutex_);
    if (stopping_) return;  // closes it
    resumed_.push_back(std::move(connection));
  }
  wake();
}

void RequestIntake::run() {
  std::vector<pollfd> fds;
  std::vector<Held*> polled;
  while (!stopping_) {
    take_resumed();
    held_.remove_if([](const Held& h) { return !h.connection; });  // handed on or closed
    const auto now = Clock::now();
    const bool accepting = now >= accept_paused_until_;
    fds.assign({pollfd{wake_fd_, POLLIN, 0}, pollfd{accepting ? listen_fd_ : -1, POLLIN, 0}});
    polled.clear();
    auto next = now + std::chrono::seconds(1);
    if (!accepting) next = std::min(next, accept_paused_until_);
    for (Held& h : held_) {
      fds.push_back({h.connection->fd(), POLLIN, 0});
      polled.push_back(&h);
      next = std::min(next, h.deadline);
    }
    const auto wait = std::chrono::duration_cast<std::chrono::milliseconds>(next - now).count();
    if (::poll(fds.data(), fds.size(), static_cast<int>(std::max<int64_t>(0, wait) + 1)) < 0 && errno != EINTR) break;
    if (fds[0].revents) {
      uint64_t count = 0;
      [[maybe_unused]] const ssize_t n = ::read(wake_fd_, &count, sizeof(count));
    }
    for (size_t i = 0; i < polled.size(); ++i)
      if (fds[i + 2].revents && polled[i]->connection) read_from(*polled[i]);
    if (fds[1].revents & POLLIN) accept_new();
    expire();
  }
  held_.clear();
  std::lock_guard lock(resumed_mutex_);
  resumed_.clear();
}

void RequestIntake::accept_new() {
  for (int i = 0; i < kAcceptsPerTurn; ++i) {
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)
        accept_paused_until_ = Clock::now() + kAcceptPause;
      return;  // EAGAIN: none left
    }
    const int yes = 1;  // responses go out in a few writes: no Nagle delay between them
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &yes, sizeof(yes));
    if (open_count_ >= options_.max_connections) {
      send_now(fd, response(503, error_body(503, "too many connections; try again later").dump(), true,
                            "Retry-After: 1\r\n"));
      ::close(fd);
      continue;
    }
    held_.emplace_back(std::make_unique<Connection>(fd, open_count_), Phase::reading,
                       Clock::now() + options_.request_timeout);
  }
}

void RequestIntake::read_from(Held& h) {
  std::string& buffer = h.connection->buffer;
  char chunk[16384];
  bool closed = false;
  for (size_t taken = 0; taken < (size_t(1) << 20);) {  // at most 1 MiB a turn: others are served too
    const ssize_t n = ::recv(h.connection->fd(), chunk, sizeof(chunk), MSG_DONTWAIT);
    if (n > 0) {
      if (h.phase != Phase::closing) buffer.append(chunk, static_cast<size_t>(n));
      taken += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    closed = n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK);
    break;
  }
  if (h.phase != Phase::closing) advance(h);
  // A client that closed its side may still read the answer to a request it completed
  // (handed to a handler above); anything else on a closed connection is dropped.
  if (closed && h.connection) h.connection.reset();
}

void RequestIntake::advance(Held& h) {
  while (h.connection && h.phase != Phase::closing && !h.connection->buffer.empty()) {
    std::string& buffer = h.connection->buffer;
    if (h.phase == Phase::idle) {  // the first byte of the next request: its deadline starts
      h.phase = Phase::reading;
      h.started = Clock::now();
      h.deadline = h.started + options_.request_timeout;
    }
    if (!h.head) {
      const size_t end = find_head_end(buffer, h.scanned);
      if (end == std::string::npos) {
        h.scanned = buffer.size() < 3 ? 0 : buffer.size() - 3;
        if (buffer.size() > kMaxHeadBytes) answer_and_close(h, 431, head_too_large());
        return;
      }
      // A head that arrived whole in one read is held to the same limit as one still coming.
      if (end > kMaxHeadBytes) return answer_and_close(h, 431, head_too_large());
      HeadParse parse = parse_request_head(std::string_view(buffer).substr(0, end), options_.max_body_bytes);
      if (!parse.ok) return answer_and_close(h, parse.status, parse.message);
      if (buffered_bytes_ + parse.head.body_bytes > options_.max_buffered_bytes)
        return answer_and_close(h, 503, "the server holds too many request bodies; try again later",
                                "Retry-After: 1\r\n");
      h.body = BodyReservation(buffered_bytes_, parse.head.body_bytes);
      h.head = std::move(parse.head);
    }
    const RequestHead& head = *h.head;
    const uint64_t total = head.head_bytes + head.body_bytes;
    if (buffer.size() < total) {
      if (head.expects_continue && !h.continue_sent) {
        h.continue_sent = true;
        if (!send_now(h.connection->fd(), "HTTP/1.1 100 Continue\r\n\r\n")) h.connection.reset();
      }
      return;
    }
    if (head.method == "GET" && head.path == "/health") {
      const bool keep = head.keep_alive;
      buffer.erase(0, total);
      const auto started = h.started;
      if (options_.answered) options_.answered(&head, 200, started);  // before `h` is replaced: head is in it
      h = Held{std::move(h.connection), Phase::idle, Clock::now() + options_.keep_alive_timeout};
      if (!send_now(h.connection->fd(), response(200, R"({"status":"ok"})", !keep)) || !keep) h.connection.reset();
      continue;
    }
    auto ready = std::make_shared<ReadyRequest>();
    ready->head = head;
    ready->started = h.started;
    ready->bytes = buffer.substr(0, total);
    if (head.expects_continue) ready->bytes.erase(head.expect_begin, head.expect_end - head.expect_begin);
    buffer.erase(0, total);
    ready->connection = std::move(h.connection);
    ready->body = std::move(h.body);
    if (!dispatch_(ready)) {
      Held refused(std::move(ready->connection), Phase::reading, Clock::now());
      refused.head = ready->head;
      refused.started = ready->started;
      answer_and_close(refused, 503, "the server is busy (its request queue is full); try again later",
                       "Retry-After: 1\r\n");
      if (refused.connection) held_.push_back(std::move(refused));
    }
    return;
  }
}

// Answers from the intake and closes, draining what the client still sends for a while
// first: closing a socket with unread input resets it, and the client may then never see
// the answer (a 413 sent while its body is on the way).
void RequestIntake::answer_and_close(Held& h, int status, const std::string& message, const char* extra_headers) {
  if (options_.answered) options_.answered(h.head ? &*h.head : nullptr, status, h.started);
  const bool sent = send_now(h.connection->fd(), response(status, error_body(status, message).dump(), true, extra_headers));
  if (!sent || ::shutdown(h.connection->fd(), SHUT_WR) != 0) {
    h.connection.reset();
    return;
  }
  h.connection->buffer.clear();
  h.head.reset();
  h.body = BodyReservation();
  h.phase = Phase::closing;
  h.deadline = Clock::now() + kLingerTime;
}

void RequestIntake::expire() {
  const auto now = Clock::now();
  for (Held& h : held_) {
    if (!h.connection || now < h.deadline) continue;
    if (h.phase == Phase::reading && !h.connection->buffer.empty())
      answer_and_close(h, 408,
                       fmt::format("the request did not arrive whole within {} s",
                                   static_cast<double>(options_.request_timeout.count()) / 1000));
    else
      h.connection.reset();  // idle past keep-alive, silent since accepted, or done draining
  }
}

void RequestIntake::take_resumed() {
  std::vector<std::unique_ptr<Connection>> resumed;
  {
    std::lock_guard lock(resumed_mutex_);
    resumed.swap(resumed_);
  }
  for (auto& c : resumed) {
    held_.emplace_back(std::move(c), Phase::idle, Clock::now() + options_.keep_alive_timeout);
    advance(held_.back());  // a request the client sent before the last answer (pipelining)
  }
}

}  // namespace kiln::serve

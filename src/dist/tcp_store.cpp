#include "dist/tcp_store.h"

#include "core/error.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

namespace kiln::dist {

namespace {

// A request: op (1 byte: 'S' set, 'G' get, 'P' peek), key length, key, then for 'S' the
// value's length and the value. A get is answered with the value's length and the value
// once the key exists; a peek at once, with a byte saying whether the key exists and, if
// so, the value, its age (ms, int64) and a byte saying whether the connection that set it
// has closed. Lengths are 32-bit, host order (every rank runs this same program).
constexpr char kSet = 'S', kGet = 'G', kPeek = 'P';

enum class ReadResult { done, closed, timed_out };

// Reads exactly `bytes` from fd, each part awaited until `deadline` (none: as long as it
// takes). closed: the peer went away or the socket failed.
ReadResult read_exact(int fd, void* data, size_t bytes,
                      std::optional<std::chrono::steady_clock::time_point> deadline = std::nullopt) {
  auto* p = static_cast<char*>(data);
  while (bytes > 0) {
    if (deadline) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(*deadline - std::chrono::steady_clock::now());
      pollfd pfd{fd, POLLIN, 0};
      const int ready = left.count() > 0 ? ::poll(&pfd, 1, static_cast<int>(left.count())) : 0;
      if (ready < 0 && errno == EINTR) continue;
      if (ready <= 0) return ReadResult::timed_out;
    }
    const ssize_t n = ::recv(fd, p, bytes, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return ReadResult::closed;
    p += n;
    bytes -= static_cast<size_t>(n);
  }
  return ReadResult::done;
}

bool read_exact_or_closed(int fd, void* data, size_t bytes) {
  return read_exact(fd, data, bytes) == ReadResult::done;
}

bool write_exact(int fd, const void* data, size_t bytes) {
  const auto* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::send(fd, p, bytes, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    p += n;
    bytes -= static_cast<size_t>(n);
  }
  return true;
}

bool read_string(int fd, std::string& s) {
  uint32_t n = 0;
  if (!read_exact_or_closed(fd, &n, sizeof(n))) return false;
  s.resize(n);
  return read_exact_or_closed(fd, s.data(), n);
}

bool write_string(int fd, const std::string& s) {
  const auto n = static_cast<uint32_t>(s.size());
  return write_exact(fd, &n, sizeof(n)) && write_exact(fd, s.data(), n);
}

}  // namespace

// Rank 0's side: one thread accepts, one thread per connection answers; a get waits on
// the map's condition variable until its key is set or the server stops.
class TcpStore::Server {
 public:
  explicit Server(int port) {
    listen_fd_ = ::socket(AF_INET6, SOCK_STREAM, 0);
    bool v6 = listen_fd_ >= 0;
    if (!v6) listen_fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    KILN_CHECK(listen_fd_ >= 0, "dist", "rendezvous: no socket: {}", std::strerror(errno));
    const int one = 1, zero = 0;
    ::setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    int bound = -1;
    if (v6) {
      ::setsockopt(listen_fd_, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));  // IPv4 peers too
      sockaddr_in6 a{};
      a.sin6_family = AF_INET6;
      a.sin6_addr = in6addr_any;
      a.sin6_port = htons(static_cast<uint16_t>(port));
      bound = ::bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a));
    } else {
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_addr.s_addr = htonl(INADDR_ANY);
      a.sin_port = htons(static_cast<uint16_t>(port));
      bound = ::bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a));
    }
    if (bound != 0 || ::listen(listen_fd_, 128) != 0) {
      const int error = errno;
      ::close(listen_fd_);
      fail("dist", "rendezvous: rank 0 cannot listen on port {} (MASTER_PORT): {}", port, std::strerror(error));
    }
    acceptor_ = std::thread([this] { accept_loop(); });
  }

  ~Server() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
      for (int fd : clients_) ::shutdown(fd, SHUT_RDWR);
    }
    changed_.notify_all();
    ::shutdown(listen_fd_, SHUT_RDWR);
    ::close(listen_fd_);
    acceptor_.join();
    for (std::thread& t : handlers_) t.join();
    for (int fd : clients_) ::close(fd);
  }

 private:
  void accept_loop() {
    for (;;) {
      const int fd = ::accept(listen_fd_, nullptr, nullptr);
      std::lock_guard lock(mutex_);
      if (stopping_) {
        if (fd >= 0) ::close(fd);
        return;
      }
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        return;
      }
      clients_.push_back(fd);
      handlers_.emplace_back([this, fd] { serve(fd); });
    }
  }

  // When a connection ends, the keys it set last are marked: their writer died or exited.
  void serve(int fd) {
    talk(fd);
    std::lock_guard lock(mutex_);
    for (auto& [key, stamp] : stamps_)
      if (stamp.writer == fd) stamp.writer_gone = true;
  }

  void talk(int fd) {
    for (;;) {
      char op = 0;
      std::string key, value;
      if (!read_exact_or_closed(fd, &op, 1) || !read_string(fd, key)) return;
      if (op == kSet) {
        if (!read_string(fd, value)) return;
        {
          std::lock_guard lock(mutex_);
          values_[key] = std::move(value);
          stamps_[key] = {std::chrono::steady_clock::now(), fd, false};
        }
        changed_.notify_all();
      } else if (op == kGet) {
        std::unique_lock lock(mutex_);
        changed_.wait(lock, [&] { return stopping_ || values_.contains(key); });
        if (stopping_) return;
        value = values_[key];
        lock.unlock();
        if (!write_string(fd, value)) return;
      } else if (op == kPeek) {
        std::string reply;
        {
          std::lock_guard lock(mutex_);
          const auto found = values_.find(key);
          reply.push_back(found != values_.end() ? 1 : 0);
          if (found != values_.end()) {
            const Stamp& stamp = stamps_[key];
            const auto n = static_cast<uint32_t>(found->second.size());
            const int64_t age = std::chrono::duration_cast<std::chrono::milliseconds>(
                                    std::chrono::steady_clock::now() - stamp.when).count();
            reply.append(reinterpret_cast<const char*>(&n), sizeof(n)).append(found->second);
            reply.append(reinterpret_cast<const char*>(&age), sizeof(age));
            reply.push_back(stamp.writer_gone ? 1 : 0);
          }
        }
        if (!write_exact(fd, reply.data(), reply.size())) return;
      } else {
        return;  // not a kiln rank: drop it
      }
    }
  }

  int listen_fd_ = -1;
  std::thread acceptor_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::map<std::string, std::string> values_;
  // When each key was last set, on this (rank 0's) clock, and by which connection.
  struct Stamp {
    std::chrono::steady_clock::time_point when;
    int writer = -1;
    bool writer_gone = false;
  };
  std::map<std::string, Stamp> stamps_;
  std::vector<int> clients_;
  std::vector<std::thread> handlers_;
  bool stopping_ = false;
};

namespace {

// One connection attempt to every address of host:port; -1 when none answers. `lookup`
// gets getaddrinfo's result (0 when the name resolved).
int try_connect(const std::string& host, int port, int& lookup) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  lookup = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
  if (lookup != 0) return -1;
  int fd = -1;
  for (addrinfo* a = found; a != nullptr && fd < 0; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype, a->ai_protocol);
    if (fd < 0) continue;
    if (::connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
      ::close(fd);
      fd = -1;
    }
  }
  ::freeaddrinfo(found);
  return fd;
}

}  // namespace

TcpStore::TcpStore(const std::string& host, int port, bool serve, std::chrono::milliseconds timeout)
    : address_(host + ":" + std::to_string(port)), timeout_(timeout) {
  if (serve) server_ = std::make_unique<Server>(port);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    int lookup = 0;
    socket_ = try_connect(host, port, lookup);
    if (socket_ >= 0) break;
    // A name no resolver knows is a typo, said at once; it used to wait out dist.timeout
    // and then blame rank 0 ("no answer"). EAI_AGAIN (no resolver reached yet) is retried.
    KILN_CHECK(lookup == 0 || lookup == EAI_AGAIN, "dist", "rendezvous: MASTER_ADDR '{}' does not resolve: {}", host,
               ::gai_strerror(lookup));
    const bool late = std::chrono::steady_clock::now() >= deadline;
    KILN_CHECK(!late || lookup == 0, "dist", "rendezvous: MASTER_ADDR '{}' does not resolve within {} s: {}", host,
               timeout.count() / 1000.0, ::gai_strerror(lookup));
    KILN_CHECK(!late, "dist", "rendezvous: no answer from rank 0 at {} (MASTER_ADDR:MASTER_PORT) within {} s",
               address_, timeout.count() / 1000.0);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  const int one = 1;
  ::setsockopt(socket_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

TcpStore::~TcpStore() {
  if (socket_ >= 0) ::close(socket_);
}

void TcpStore::send_all(const void* data, size_t bytes, const std::string& key) {
  KILN_CHECK(write_exact(socket_, data, bytes), "dist", "rendezvous at {}: lost while setting '{}': {}", address_,
             key, std::strerror(errno));
}

void TcpStore::receive_all(void* data, size_t bytes, const std::string& key) {
  const ReadResult r = read_exact(socket_, data, bytes, std::chrono::steady_clock::now() + timeout_);
  KILN_CHECK(r != ReadResult::timed_out, "dist", "rendezvous at {}: '{}' was not set by any rank within {} s", address_,
             key, timeout_.count() / 1000.0);
  KILN_CHECK(r == ReadResult::done, "dist", "rendezvous at {}: rank 0 went away while '{}' was awaited", address_, key);
}

void TcpStore::set(const std::string& key, const std::string& value) {
  std::string request(1, kSet);
  const auto k = static_cast<uint32_t>(key.size()), v = static_cast<uint32_t>(value.size());
  request.append(reinterpret_cast<const char*>(&k), sizeof(k)).append(key);
  request.append(reinterpret_cast<const char*>(&v), sizeof(v)).append(value);
  send_all(request.data(), request.size(), key);
}

std::string TcpStore::get(const std::string& key) {
  std::string request(1, kGet);
  const auto k = static_cast<uint32_t>(key.size());
  request.append(reinterpret_cast<const char*>(&k), sizeof(k)).append(key);
  send_all(request.data(), request.size(), key);
  uint32_t n = 0;
  receive_all(&n, sizeof(n), key);
  std::string value(n, '\0');
  receive_all(value.data(), n, key);
  return value;
}

TcpStore::Peek TcpStore::peek(const std::string& key) {
  std::string request(1, kPeek);
  const auto k = static_cast<uint32_t>(key.size());
  request.append(reinterpret_cast<const char*>(&k), sizeof(k)).append(key);
  Peek out;
  if (!write_exact(socket_, request.data(), request.size())) {
    out.status = Peek::lost;
    return out;
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  auto read = [&](void* data, size_t bytes) {
    const ReadResult r = read_exact(socket_, data, bytes, deadline);
    if (r != ReadResult::done) out.status = r == ReadResult::timed_out ? Peek::timed_out : Peek::lost;
    return r == ReadResult::done;
  };
  char found = 0, gone = 0;
  uint32_t n = 0;
  int64_t age = 0;
  if (!read(&found, 1)) return out;
  if (found == 0) {
    out.status = Peek::absent;
    return out;
  }
  if (!read(&n, sizeof(n))) return out;
  out.value.resize(n);
  if (!read(out.value.data(), n) || !read(&age, sizeof(age)) || !read(&gone, 1)) return out;
  out.status = Peek::found;
  out.age = std::chrono::milliseconds(age);
  out.writer_gone = gone != 0;
  return out;
}

}  // namespace kiln::dist

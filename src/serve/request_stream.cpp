#include "serve/request_stream.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>

namespace kiln::serve {

namespace {

thread_local RequestStream* serving = nullptr;

void address_of(const sockaddr_storage& addr, socklen_t len, std::string& ip, int& port) {
  char host[NI_MAXHOST] = "", service[NI_MAXSERV] = "";
  if (getnameinfo(reinterpret_cast<const sockaddr*>(&addr), len, host, sizeof(host), service, sizeof(service),
                  NI_NUMERICHOST | NI_NUMERICSERV) == 0) {
    ip = host;
    port = std::atoi(service);
  }
}

}  // namespace

RequestStream* RequestStream::current() { return serving; }
RequestStream::Serving::Serving(RequestStream& stream) { serving = &stream; }
RequestStream::Serving::~Serving() { serving = nullptr; }

RequestStream::RequestStream(int fd, std::string request, std::chrono::milliseconds write_timeout)
    : fd_(fd), request_(std::move(request)), write_timeout_(write_timeout) {}

bool RequestStream::is_writable() const { return !write_failed_; }

ssize_t RequestStream::read(char* ptr, size_t size) {
  const size_t n = std::min(size, request_.size() - read_);
  std::memcpy(ptr, request_.data() + read_, n);
  read_ += n;
  return static_cast<ssize_t>(n);
}

ssize_t RequestStream::write(const char* ptr, size_t size) {
  if (discarding_ && !write_failed_) return static_cast<ssize_t>(size);
  return write_raw(ptr, size);
}

ssize_t RequestStream::write_raw(const char* ptr, size_t size) {
  using Clock = std::chrono::steady_clock;
  if (write_failed_) return -1;
  if (write_deadline_ == Clock::time_point{}) write_deadline_ = Clock::now() + write_timeout_;
  size_t sent = 0;
  while (sent < size) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(write_deadline_ - Clock::now()).count();
    pollfd p{fd_, POLLOUT, 0};
    const int ready = left > 0 ? ::poll(&p, 1, static_cast<int>(left)) : 0;
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0 || (p.revents & (POLLERR | POLLHUP))) {
      write_failed_ = true;
      return -1;
    }
    const ssize_t n = ::send(fd_, ptr + sent, size - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    if (n <= 0) {
      write_failed_ = true;
      return -1;
    }
    sent += static_cast<size_t>(n);
  }
  return static_cast<ssize_t>(size);
}

void RequestStream::get_remote_ip_and_port(std::string& ip, int& port) const {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  if (getpeername(fd_, reinterpret_cast<sockaddr*>(&addr), &len) == 0) address_of(addr, len, ip, port);
}

void RequestStream::get_local_ip_and_port(std::string& ip, int& port) const {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  if (getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len) == 0) address_of(addr, len, ip, port);
}

}  // namespace kiln::serve

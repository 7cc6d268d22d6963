#include "serve/listen_socket.h"

#include "core/error.h"

#include <arpa/inet.h>
#include <cerrno>
#include <cstring>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

namespace kiln::serve {

namespace {

int bound_port(int fd) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return -1;
  if (addr.ss_family == AF_INET) return ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  if (addr.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port);
  return -1;
}

}  // namespace

ListenSocket::ListenSocket(const std::string& host, int port) {
  KILN_CHECK(port >= 0 && port <= 65535, "serve", "port {} is outside 0-65535 (0 = any free port)", port);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  if (const int rc = getaddrinfo(host.c_str(), service.c_str(), &hints, &found); rc != 0)
    fail("serve", "cannot listen on {}:{}: {}", host, port, gai_strerror(rc));
  int error = 0;
  for (addrinfo* a = found; a != nullptr && fd_ < 0; a = a->ai_next) {
    // Non-blocking: RequestIntake accepts until the backlog is empty, and must not wait there.
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
    if (fd < 0) {
      error = errno;
      continue;
    }
    const int yes = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    // SOMAXCONN: the kernel caps it at net.core.somaxconn (4096 on current kernels).
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, SOMAXCONN) == 0) {
      fd_ = fd;
    } else {
      error = errno;
      ::close(fd);
    }
  }
  freeaddrinfo(found);
  if (fd_ < 0)
    fail("serve", "cannot listen on {}:{}: {}{}", host, port, std::strerror(error),
         error == EADDRINUSE ? " (another server is on this port)" : "");
  port_ = bound_port(fd_);
}

ListenSocket::~ListenSocket() { close(); }

void ListenSocket::close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

bool is_loopback_host(const std::string& host) {
  if (host == "localhost") return true;
  in_addr v4{};
  if (inet_pton(AF_INET, host.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6{};
  return inet_pton(AF_INET6, host.c_str(), &v6) == 1 && IN6_IS_ADDR_LOOPBACK(&v6);
}

}  // namespace kiln::serve

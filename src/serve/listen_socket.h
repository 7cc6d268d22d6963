// The listening TCP socket of `kiln serve`, made by kiln rather than by httplib: Debian's
// compiled cpp-httplib 0.11 sets SO_REUSEPORT on its socket (so a second server on the
// same port starts, and the kernel splits connections between the two models) and
// listens with a backlog of 5 (CPPHTTPLIB_LISTEN_BACKLOG, fixed when the library was
// built: a burst of concurrent clients is refused). This one is exclusive (SO_REUSEADDR
// only, which on Linux lets a restarted server bind past TIME_WAIT but never beside a
// live listener) and listens with the kernel's maximum backlog.
#pragma once

#include <string>

namespace kiln::serve {

class ListenSocket {
 public:
  // Binds host:port (port 0: any free port; see port()) and listens. Throws kiln::Error
  // ("[serve] ...") naming host and port when the port is out of range, the host does not
  // resolve, or the address is taken.
  ListenSocket(const std::string& host, int port);
  ~ListenSocket();
  ListenSocket(const ListenSocket&) = delete;
  ListenSocket& operator=(const ListenSocket&) = delete;

  int fd() const { return fd_; }
  // Stops listening: from here a new connection is refused. port() stays.
  void close();
  int port() const { return port_; }  // the bound port, also when asked for 0

 private:
  int fd_ = -1;
  int port_ = 0;
};

// True for 127.0.0.0/8, ::1 and "localhost": addresses no other machine can reach.
bool is_loopback_host(const std::string& host);

}  // namespace kiln::serve

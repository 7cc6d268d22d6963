// The httplib::Stream a handler thread serves one request through. Reads come from the
// request's bytes, which RequestIntake has already read whole, so a handler thread never
// waits on a client's upload (a slow client holds no thread); at their end the stream
// reads as closed. Writes go to the socket within one deadline for the whole response
// (httplib's own timeout is per write call, which a client reading a byte at a time
// never trips).
#pragma once

#include <httplib.h>

#include <chrono>
#include <string>

namespace kiln::serve {

class RequestStream final : public httplib::Stream {
 public:
  RequestStream(int fd, std::string request, std::chrono::milliseconds write_timeout);

  bool is_readable() const override { return read_ < request_.size(); }
  bool is_writable() const override;
  ssize_t read(char* ptr, size_t size) override;
  ssize_t write(const char* ptr, size_t size) override;
  void get_remote_ip_and_port(std::string& ip, int& port) const override;
  void get_local_ip_and_port(std::string& ip, int& port) const override;
  socket_t socket() const override { return fd_; }

  bool write_failed() const { return write_failed_; }

 private:
  const int fd_;
  const std::string request_;
  size_t read_ = 0;
  const std::chrono::milliseconds write_timeout_;
  std::chrono::steady_clock::time_point write_deadline_{};  // set by the first write
  bool write_failed_ = false;
};

}  // namespace kiln::serve

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
  ssize_t write(const char* ptr, size_t size) override;  // httplib's (dropped once discarding)
  ssize_t write_raw(const char* ptr, size_t size);       // a handler's own answer
  // The write deadline bounds one whole answer; a stream, which may run for minutes,
  // restarts it at each event, so it bounds each event's write instead.
  void restart_write_deadline() { write_deadline_ = {}; }
  void get_remote_ip_and_port(std::string& ip, int& port) const override;
  void get_local_ip_and_port(std::string& ip, int& port) const override;
  socket_t socket() const override { return fd_; }

  bool write_failed() const { return write_failed_; }
  // A handler wrote its own answer (an event stream, serve/sse.h): what httplib writes
  // after the handler returns is dropped.
  void discard_further_writes() { discarding_ = true; }
  bool answered_by_handler() const { return discarding_; }
  // The connection is not to be reused: its client went away mid-answer (fail) or the
  // answer is to end with the connection (close: asked for, or an HTTP/1.0 event stream).
  void fail() { write_failed_ = true; }
  void set_close(bool close) { close_ = close; }
  bool close() const { return close_; }

  // The stream the calling thread serves now (set by Serving, in CompletionServer::handle):
  // httplib passes a handler no stream, and a streaming handler writes to it itself.
  static RequestStream* current();
  class Serving {
   public:
    explicit Serving(RequestStream& stream);
    ~Serving();
    Serving(const Serving&) = delete;
    Serving& operator=(const Serving&) = delete;
  };

 private:
  const int fd_;
  const std::string request_;
  size_t read_ = 0;
  const std::chrono::milliseconds write_timeout_;
  std::chrono::steady_clock::time_point write_deadline_{};  // set by the first write
  bool write_failed_ = false;
  bool discarding_ = false;
  bool close_ = false;
};

}  // namespace kiln::serve

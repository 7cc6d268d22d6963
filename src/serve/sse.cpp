#include "serve/sse.h"

#include "serve/request_stream.h"

#include <fmt/format.h>

#include <poll.h>
#include <sys/socket.h>

namespace kiln::serve {

using nlohmann::json;

std::string sse_event(const json& data) {
  return "data: " + data.dump(-1, ' ', false, json::error_handler_t::replace) + "\n\n";
}

std::string http_chunk(std::string_view bytes) { return fmt::format("{:x}\r\n{}\r\n", bytes.size(), bytes); }

std::string sse_response_head(bool chunked, bool close) {
  // no-cache and X-Accel-Buffering: a proxy in front must pass each event on as it comes.
  return fmt::format(
      "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
      "X-Accel-Buffering: no\r\n{}{}\r\n",
      chunked ? "Transfer-Encoding: chunked\r\n" : "", close || !chunked ? "Connection: close\r\n" : "");
}

SseWriter::SseWriter(RequestStream& stream, bool chunked, bool close)
    : stream_(stream), chunked_(chunked), close_(close) {}

bool SseWriter::send(std::string_view payload) {
  stream_.restart_write_deadline();
  if (ok_) ok_ = stream_.write_raw(payload.data(), payload.size()) == static_cast<ssize_t>(payload.size());
  return ok_;
}

bool SseWriter::begin() { return send(sse_response_head(chunked_, close_)); }

bool SseWriter::event(const json& data) {
  const std::string e = sse_event(data);
  return send(chunked_ ? http_chunk(e) : e);
}

bool SseWriter::done() {
  if (!chunked_) return send(kSseDone);
  return send(http_chunk(kSseDone) + "0\r\n\r\n");
}

bool SseWriter::client_gone() const {
  if (!ok_) return true;
  // POLLRDHUP: the client closed its end. A streaming client reads until [DONE], so one
  // that closed has gone away (a request it pipelined after this one shows as POLLIN alone).
  pollfd p{stream_.socket(), POLLRDHUP, 0};
  return ::poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR));
}

}  // namespace kiln::serve

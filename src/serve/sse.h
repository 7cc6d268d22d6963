// Server-sent events (text/event-stream) as OpenAI's streaming endpoints send them: each
// chunk one event "data: {json}\n\n", the stream ended by "data: [DONE]\n\n". The HTTP
// framing is written here too, not by httplib: httplib 0.11 runs a content provider only
// while its own listening socket is open, and kiln serves on a socket of its own
// (serve/listen_socket.h), so a provider of httplib's would write no byte.
#pragma once

#include <nlohmann/json.hpp>

#include <string>
#include <string_view>

namespace kiln::serve {

class RequestStream;

// One event: "data: " + the JSON on one line + "\n\n" (invalid UTF-8, from a byte-level
// model stopping mid-character, replaced rather than thrown on).
std::string sse_event(const nlohmann::json& data);
inline constexpr std::string_view kSseDone = "data: [DONE]\n\n";

// One HTTP/1.1 chunk of `bytes`: hex length, CRLF, the bytes, CRLF.
std::string http_chunk(std::string_view bytes);

// The head of a 200 event-stream answer: chunked (HTTP/1.1, the connection kept unless
// `close`), or ended by closing the connection (`chunked` false: an HTTP/1.0 client).
std::string sse_response_head(bool chunked, bool close);

// Writes one event stream on a handler's RequestStream.
class SseWriter {
 public:
  SseWriter(RequestStream& stream, bool chunked, bool close);
  // Each false once a write failed (the client went away); nothing more is sent then.
  bool begin();
  bool event(const nlohmann::json& data);
  bool done();  // [DONE], then the chunked stream's last chunk
  // True when the client has closed the connection (or it broke) while nothing was being
  // written: a waiting stream notices without a write.
  bool client_gone() const;

 private:
  bool send(std::string_view payload);

  RequestStream& stream_;
  const bool chunked_, close_;
  bool ok_ = true;
};

}  // namespace kiln::serve

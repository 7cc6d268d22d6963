// The framing of one HTTP/1.1 request, decided from its head alone (before any body byte
// is read): where the head ends, how long the body is, and whether the request can be
// taken at all. RequestIntake uses it to read whole requests without a thread each and to
// answer a bad or oversized Content-Length at once; httplib parses the request again
// (method, target, headers) when a handler serves it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace kiln::serve {

struct RequestHead {
  std::string method;
  std::string path;                 // the target without its query
  size_t head_bytes = 0;            // request line and headers, through the blank line
  uint64_t body_bytes = 0;          // Content-Length (0 when absent)
  bool keep_alive = true;           // HTTP/1.1 without "Connection: close" (1.0: with keep-alive)
  bool expects_continue = false;    // "Expect: 100-continue"
  size_t expect_begin = 0, expect_end = 0;  // that header line's bytes (dropped before httplib sees it)
};

struct HeadParse {
  bool ok = false;
  RequestHead head;                 // when ok
  int status = 0;                   // otherwise the answer: 400, 413, 501
  std::string message;
};

// Where the head in `bytes` ends (one past its blank line), searching from `from` (bytes
// before it were searched already); npos while incomplete.
size_t find_head_end(std::string_view bytes, size_t from);

// Parses a complete head (bytes up to find_head_end()). Content-Length must be digits
// only (else 400), agree when repeated (else 400) and be at most max_body_bytes (else 413);
// Transfer-Encoding is refused (501): every client kiln serves sends a length.
HeadParse parse_request_head(std::string_view head, uint64_t max_body_bytes);

}  // namespace kiln::serve

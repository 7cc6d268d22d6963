// The access log of `kiln serve`: one line on stderr per answered request, written whole
// by one call so lines of concurrent requests never interleave. Its format is stable
// (docs/serving.md, "Operations"): scripts may parse it.
//   kiln: access: POST /v1/completions 200 prompt_tokens=5 completion_tokens=16 ms=41.7
// `ms` runs from the request's first byte to its answer's last (a stream's [DONE]).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

namespace kiln::serve {

std::string access_line(const std::string& method, const std::string& path, int status, int64_t prompt_tokens,
                        int64_t completion_tokens, double milliseconds);
void write_access_line(const std::string& line);  // to stderr, with its newline, in one write

// The tokens of the request a handler thread is answering, added to by the model's thread
// as the request's sequences end. Shared: a stream whose client left is answered (and
// logged) before its cancelled sequences end.
struct RequestTally {
  std::atomic<int64_t> prompt_tokens{0}, completion_tokens{0};
};

// The tally of the request this thread answers; null outside TallyScope. Thread-local
// because httplib's handlers have no per-request context to carry it in.
std::shared_ptr<RequestTally> current_tally();
class TallyScope {
 public:
  explicit TallyScope(std::shared_ptr<RequestTally> tally);
  ~TallyScope();
  TallyScope(const TallyScope&) = delete;
  TallyScope& operator=(const TallyScope&) = delete;
};

}  // namespace kiln::serve

#include "serve/access_log.h"

#include <fmt/format.h>

#include <unistd.h>

namespace kiln::serve {

namespace {

thread_local std::shared_ptr<RequestTally> tally;

// A path as the client sent it may hold anything; the line stays one line of printable
// ASCII so it parses by spaces.
std::string printable(const std::string& s) {
  std::string out;
  for (unsigned char c : s) out += (c > 0x20 && c < 0x7f) ? std::string(1, static_cast<char>(c)) : fmt::format("%{:02X}", c);
  return out.empty() ? "-" : out;
}

}  // namespace

std::string access_line(const std::string& method, const std::string& path, int status, int64_t prompt_tokens,
                        int64_t completion_tokens, double milliseconds) {
  return fmt::format("kiln: access: {} {} {} prompt_tokens={} completion_tokens={} ms={:.1f}", printable(method),
                     printable(path), status, prompt_tokens, completion_tokens, milliseconds);
}

void write_access_line(const std::string& line) {
  const std::string whole = line + "\n";
  size_t done = 0;
  while (done < whole.size()) {  // one write() for a line this short; the loop is for EINTR
    const ssize_t n = ::write(STDERR_FILENO, whole.data() + done, whole.size() - done);
    if (n <= 0) return;
    done += static_cast<size_t>(n);
  }
}

std::shared_ptr<RequestTally> current_tally() { return tally; }

TallyScope::TallyScope(std::shared_ptr<RequestTally> t) { tally = std::move(t); }
TallyScope::~TallyScope() { tally.reset(); }

}  // namespace kiln::serve

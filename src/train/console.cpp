#include "train/console.h"

#include "core/error.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>

namespace kiln {

namespace {
constexpr const char* kClearLine = "\r\033[2K";  // to the line's start, erase it
}

Console::Console() {
  const char* plain = std::getenv("KILN_PLAIN");
  live_ = isatty(fileno(stdout)) != 0 && !(plain != nullptr && *plain != '\0' && std::string_view(plain) != "0");
}

void Console::message(std::string text) const {
  if (text.empty() || text.back() != '\n') text += '\n';
  if (live_ && !line_.empty()) {
    std::fputs(kClearLine, stdout);
    std::fputs(text.c_str(), stdout);
    std::fputs(line_.c_str(), stdout);  // the progress line again, below the message
  } else {
    std::fputs(text.c_str(), stdout);
  }
  std::fflush(stdout);  // a log read while the run goes on sees it now
}

void Console::warn(std::string_view where, std::string_view text) const {
  if (live_ && !line_.empty()) std::fputs(kClearLine, stdout);
  kiln::warn(where, text);
  if (live_ && !line_.empty()) std::fputs(line_.c_str(), stdout);
  std::fflush(stdout);
}

void Console::progress(const std::string& line) {
  if (!live_) return;
  line_ = line;
  std::fputs(kClearLine, stdout);
  std::fputs(line_.c_str(), stdout);
  std::fflush(stdout);
}

void Console::finish_line() {
  if (live_ && !line_.empty()) std::fputs("\n", stdout);
  line_.clear();
  std::fflush(stdout);
}

}  // namespace kiln

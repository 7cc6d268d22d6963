#include "train/console.h"

#include "core/error.h"

#include <sys/ioctl.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>

namespace kiln {

namespace {

constexpr const char* kClearLine = "\r\033[2K";  // to the line's start, erase it

// The terminal's columns now (it may have been resized), or 0 when unknown.
int terminal_columns() {
  winsize size{};
  if (ioctl(fileno(stdout), TIOCGWINSZ, &size) != 0) return 0;
  return size.ws_col;
}

}  // namespace

std::string fit_to_width(const std::string& line, int columns) {
  if (columns <= 0) return line;
  const size_t limit = static_cast<size_t>(columns - 1);
  size_t characters = 0;
  for (size_t i = 0; i < line.size(); ++i) {
    const bool starts_character = (static_cast<unsigned char>(line[i]) & 0xC0) != 0x80;
    if (starts_character && characters++ == limit) return line.substr(0, i);
  }
  return line;
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
  line_ = fit_to_width(line, terminal_columns());
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

// The trainer's console. On a terminal, one progress line updates in place after every
// step (step/total, loss, the last validation loss, tokens/s, MFU on the GPU, elapsed,
// ETA) and every other message scrolls above it; elsewhere (a file, a pipe, CI) each
// message is a plain line, as the log has always been, and the periodic step lines keep
// their log.every cadence. KILN_PLAIN=1 asks for plain lines on a terminal too. The live
// line is cut to the terminal's width, read at every redraw: a line that wrapped would
// leave its first row behind at each redraw (the erase reaches only the cursor's row).
#pragma once

#include <fmt/format.h>

#include <string>
#include <string_view>

namespace kiln {

// `line` cut to at most columns - 1 characters (UTF-8 code points, never split), so
// the cursor stays on the line's row; unchanged when columns <= 0 (width unknown).
std::string fit_to_width(const std::string& line, int columns);

class Console {
 public:
  Console();  // live when stdout is a terminal and KILN_PLAIN is unset
  bool live() const { return live_; }

  // A message line (newline added where the format has none at its end).
  template <typename... Args>
  void print(fmt::format_string<Args...> format, Args&&... args) const {
    message(fmt::format(format, std::forward<Args>(args)...));
  }
  void message(std::string text) const;
  // A warning (stderr, as kiln::warn prints it), kept off the progress line.
  void warn(std::string_view where, std::string_view text) const;
  // Redraws the live progress line (a no-op when not live).
  void progress(const std::string& line);
  // Ends the live line, so what follows starts on a line of its own.
  void finish_line();

 private:
  bool live_ = false;
  std::string line_;  // the progress line shown now ("" = none)
};

}  // namespace kiln

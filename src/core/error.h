// kiln::Error and the checks that raise it.
//
// Every user-facing failure is one line: "[where] what went wrong". `where` is an
// op name ("rms_norm"), a config key ("model.layers") or a file ("data.txt:12").
#pragma once

#include <fmt/format.h>

#include <cstdio>
#include <stdexcept>
#include <string>
#include <string_view>

namespace kiln {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

template <typename... Args>
[[noreturn]] void fail(std::string_view where, fmt::format_string<Args...> format, Args&&... args) {
  throw Error(fmt::format("[{}] {}", where, fmt::format(format, std::forward<Args>(args)...)));
}

// A problem that does not stop the command, on stderr as one line: "kiln: warning: [where]
// message" ("kiln: warning: message" when where is empty). stdout is flushed first so the
// line lands after the progress already printed.
inline void warn(std::string_view where, std::string_view message) {
  std::fflush(stdout);
  if (where.empty())
    fmt::print(stderr, "kiln: warning: {}\n", message);
  else
    fmt::print(stderr, "kiln: warning: [{}] {}\n", where, message);
}

}  // namespace kiln

// KILN_CHECK(cond, "op", "message {}", value): throws kiln::Error("[op] message ...").
#define KILN_CHECK(cond, where, ...)          \
  do {                                        \
    if (!(cond)) ::kiln::fail(where, __VA_ARGS__); \
  } while (0)

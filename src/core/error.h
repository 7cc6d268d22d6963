// kiln::Error and the checks that raise it.
//
// Every user-facing failure is one line: "[where] what went wrong". `where` is an
// op name ("rms_norm"), a config key ("model.layers") or a file ("data.txt:12").
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace kiln {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

template <typename... Args>
[[noreturn]] void fail(std::string_view where, fmt::format_string<Args...> format, Args&&... args) {
  throw Error(fmt::format("[{}] {}", where, fmt::format(format, std::forward<Args>(args)...)));
}

}  // namespace kiln

// KILN_CHECK(cond, "op", "message {}", value): throws kiln::Error("[op] message ...").
#define KILN_CHECK(cond, where, ...)          \
  do {                                        \
    if (!(cond)) ::kiln::fail(where, __VA_ARGS__); \
  } while (0)

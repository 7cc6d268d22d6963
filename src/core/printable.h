// User text (a key, a value, a token, a name read from a file) as an error quotes it:
// control bytes such as a newline become \xNN, so the error stays one line
// (core/error.h), and text past `max` bytes is cut ("...").
#pragma once

#include <fmt/format.h>

#include <string>
#include <string_view>

namespace kiln {

inline std::string printable(std::string_view text, size_t max = 80) {
  std::string out;
  for (const char c : text.substr(0, max)) {
    const auto b = static_cast<unsigned char>(c);
    if (b < 0x20 || b == 0x7f) out += fmt::format("\\x{:02x}", b);
    else out += c;
  }
  return text.size() > max ? out + "..." : out;
}

}  // namespace kiln

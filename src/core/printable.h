// Bytes from a file or a user (a key, a value, a token, a name read from a file), shown
// safely in a one-line message: control and non-ASCII bytes escaped as \xNN (a newline as
// \x0a: the error stays one line, core/error.h), and long text cut, so a corrupt or binary
// file cannot garble the terminal or flood it.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace kiln {

// `bytes` escaped, at most `max_bytes` of them shown, then "... (N bytes)".
std::string printable(std::string_view bytes, size_t max_bytes = 64);

}  // namespace kiln

// UTF-8 validation (RFC 3629: no overlong forms, no surrogates, nothing above U+10FFFF).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace kiln {

// Offset of the first byte that starts an invalid or truncated sequence; npos when
// `text` is valid UTF-8.
size_t find_invalid_utf8(std::string_view text);
inline bool is_valid_utf8(std::string_view text) { return find_invalid_utf8(text) == std::string_view::npos; }
// `text` with each byte that starts an invalid or truncated sequence replaced by U+FFFD
// (for a reader that requires UTF-8: a byte-level model's sample may cut a character).
std::string replace_invalid_utf8(std::string_view text);

}  // namespace kiln

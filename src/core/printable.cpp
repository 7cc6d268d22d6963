#include "core/printable.h"

#include <fmt/format.h>

namespace kiln {

std::string printable(std::string_view bytes, size_t max_bytes) {
  std::string out;
  const size_t shown = std::min(bytes.size(), max_bytes);
  for (size_t i = 0; i < shown; ++i) {
    const auto c = static_cast<unsigned char>(bytes[i]);
    if (c == '\\') out += "\\\\";
    else if (c < 0x20 || c >= 0x7f) out += fmt::format("\\x{:02x}", c);
    else out += static_cast<char>(c);
  }
  if (shown < bytes.size()) out += fmt::format("... ({} bytes)", bytes.size());
  return out;
}

}  // namespace kiln

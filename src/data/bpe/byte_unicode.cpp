#include "data/bpe/byte_unicode.h"

#include <array>
#include <cstring>

namespace kiln::bpe {
namespace {

struct Tables {
  std::array<char32_t, 256> to_cp{};
  std::array<int16_t, 324> to_byte{};  // every mapped code point is below 0x144
  Tables() {
    to_byte.fill(-1);
    int extra = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      to_cp[static_cast<size_t>(b)] = printable ? static_cast<char32_t>(b) : static_cast<char32_t>(256 + extra++);
      to_byte[to_cp[static_cast<size_t>(b)]] = static_cast<int16_t>(b);
    }
  }
};

const Tables& tables() {
  static const Tables t;
  return t;
}

}  // namespace

char32_t byte_to_codepoint(uint8_t b) { return tables().to_cp[b]; }

int codepoint_to_byte(char32_t c) { return c < tables().to_byte.size() ? tables().to_byte[c] : -1; }

std::string bytes_to_token(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size() * 2);
  for (const char ch : bytes) append_utf8(out, byte_to_codepoint(static_cast<uint8_t>(ch)));
  return out;
}

bool token_to_bytes(std::string_view token, std::string& out) {
  std::string bytes;
  bytes.reserve(token.size());
  for (size_t i = 0; i < token.size();) {
    const int32_t c = next_codepoint(token, i);
    const int b = c < 0 ? -1 : codepoint_to_byte(static_cast<char32_t>(c));
    if (b < 0) return false;
    bytes.push_back(static_cast<char>(b));
  }
  out = std::move(bytes);
  return true;
}

void append_utf8(std::string& out, char32_t c) {
  if (c < 0x80) {
    out.push_back(static_cast<char>(c));
  } else if (c < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (c >> 6)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else if (c < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (c >> 12)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (c >> 18)));
    out.push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  }
}

int32_t next_codepoint(std::string_view s, size_t& i) {
  const auto lead = static_cast<uint8_t>(s[i]);
  if (lead < 0x80) {
    ++i;
    return lead;
  }
  int n = 0;
  int32_t c = 0;
  int32_t min = 0;
  if ((lead & 0xE0) == 0xC0) {
    n = 1, c = lead & 0x1F, min = 0x80;
  } else if ((lead & 0xF0) == 0xE0) {
    n = 2, c = lead & 0x0F, min = 0x800;
  } else if ((lead & 0xF8) == 0xF0) {
    n = 3, c = lead & 0x07, min = 0x10000;
  } else {
    ++i;
    return -1;
  }
  if (i + static_cast<size_t>(n) >= s.size()) {
    ++i;
    return -1;
  }
  for (int k = 1; k <= n; ++k) {
    const auto b = static_cast<uint8_t>(s[i + static_cast<size_t>(k)]);
    if ((b & 0xC0) != 0x80) {
      ++i;
      return -1;
    }
    c = (c << 6) | (b & 0x3F);
  }
  if (c < min || c > 0x10FFFF || (c >= 0xD800 && c <= 0xDFFF)) {
    ++i;
    return -1;
  }
  i += static_cast<size_t>(n) + 1;
  return c;
}

bool is_ascii(std::string_view s) {
  size_t i = 0;
  for (; i + 8 <= s.size(); i += 8) {
    uint64_t v;
    std::memcpy(&v, s.data() + i, 8);
    if (v & 0x8080808080808080ull) return false;
  }
  for (; i < s.size(); ++i)
    if (static_cast<uint8_t>(s[i]) >= 0x80) return false;
  return true;
}

}  // namespace kiln::bpe

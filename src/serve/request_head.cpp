#include "serve/request_head.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <optional>

namespace kiln::serve {

namespace {

bool iequals(std::string_view a, std::string_view b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           return std::tolower(static_cast<unsigned char>(x)) == std::tolower(static_cast<unsigned char>(y));
         });
}

bool icontains(std::string_view text, std::string_view word) {
  for (size_t i = 0; i + word.size() <= text.size(); ++i)
    if (iequals(text.substr(i, word.size()), word)) return true;
  return false;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

HeadParse reject(int status, std::string message) {
  HeadParse p;
  p.status = status;
  p.message = std::move(message);
  return p;
}

// Digits only, saturating at UINT64_MAX (a length that large is over any limit anyway).
std::optional<uint64_t> parse_length(std::string_view text) {
  if (text.empty()) return std::nullopt;
  uint64_t v = 0;
  for (const char c : text) {
    if (c < '0' || c > '9') return std::nullopt;
    const auto d = static_cast<uint64_t>(c - '0');
    v = v > (UINT64_MAX - d) / 10 ? UINT64_MAX : v * 10 + d;
  }
  return v;
}

}  // namespace

size_t find_head_end(std::string_view bytes, size_t from) {
  const size_t at = bytes.find("\r\n\r\n", from);
  return at == std::string_view::npos ? at : at + 4;
}

HeadParse parse_request_head(std::string_view head, uint64_t max_body_bytes) {
  HeadParse p;
  p.head.head_bytes = head.size();
  size_t line_end = head.find("\r\n");
  const std::string_view request_line = head.substr(0, line_end);
  const size_t sp1 = request_line.find(' '), sp2 = request_line.rfind(' ');
  if (sp1 == std::string_view::npos || sp2 == sp1 || request_line.substr(sp2 + 1).rfind("HTTP/1.", 0) != 0)
    return reject(400, "malformed request line");
  p.head.method = std::string(request_line.substr(0, sp1));
  const std::string_view target = request_line.substr(sp1 + 1, sp2 - sp1 - 1);
  p.head.path = std::string(target.substr(0, target.find('?')));
  const bool http10 = request_line.substr(sp2 + 1) == "HTTP/1.0";
  p.head.keep_alive = !http10;

  std::optional<uint64_t> length;
  std::string_view length_text;
  for (size_t begin = line_end + 2; begin < head.size();) {
    const size_t end = head.find("\r\n", begin);
    const std::string_view line = head.substr(begin, end - begin);
    const size_t colon = line.find(':');
    if (!line.empty() && colon != std::string_view::npos) {
      const std::string_view name = line.substr(0, colon), value = trim(line.substr(colon + 1));
      if (iequals(name, "Content-Length")) {
        const std::optional<uint64_t> n = parse_length(value);
        if (!n) return reject(400, fmt::format("Content-Length '{}' is not a non-negative integer", value));
        if (length && *length != *n) return reject(400, "conflicting Content-Length headers");
        length = n;
        length_text = value;
      } else if (iequals(name, "Transfer-Encoding")) {
        return reject(501, "Transfer-Encoding is not supported: send the body with a Content-Length");
      } else if (iequals(name, "Connection")) {
        if (icontains(value, "close")) p.head.keep_alive = false;
        else if (http10 && icontains(value, "keep-alive")) p.head.keep_alive = true;
      } else if (iequals(name, "Expect") && iequals(value, "100-continue")) {
        p.head.expects_continue = true;
        p.head.expect_begin = begin;
        p.head.expect_end = end + 2;
      }
    }
    begin = end + 2;
  }
  p.head.body_bytes = length.value_or(0);
  if (p.head.body_bytes > max_body_bytes)
    return reject(413, fmt::format("the request body (Content-Length {}) is over the limit of {} bytes", length_text,
                                   max_body_bytes));
  p.ok = true;
  return p;
}

}  // namespace kiln::serve

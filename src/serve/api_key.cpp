#include "serve/api_key.h"

#include <algorithm>
#include <cctype>

namespace kiln::serve {

namespace {

bool iequals(std::string_view a, std::string_view b) {
  return std::ranges::equal(a, b, [](char x, char y) {
    return std::tolower(static_cast<unsigned char>(x)) == std::tolower(static_cast<unsigned char>(y));
  });
}

}  // namespace

bool bearer_matches(std::string_view authorization, std::string_view key) {
  // RFC 7235: the scheme is case-insensitive and one or more spaces end it.
  constexpr std::string_view scheme = "Bearer";
  if (authorization.size() <= scheme.size() || !iequals(authorization.substr(0, scheme.size()), scheme) ||
      authorization[scheme.size()] != ' ')
    return false;
  std::string_view given = authorization.substr(scheme.size());
  given.remove_prefix(std::min(given.find_first_not_of(' '), given.size()));
  // Every byte of the key is looked at, whatever was given; volatile keeps the compiler
  // from ending the loop at the first difference.
  volatile unsigned char difference = given.size() == key.size() ? 0 : 1;
  for (size_t i = 0; i < key.size(); ++i)
    difference = difference | static_cast<unsigned char>(key[i] ^ (i < given.size() ? given[i] : ~key[i]));
  return !key.empty() && difference == 0;
}

}  // namespace kiln::serve

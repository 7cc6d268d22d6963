#include "serve/api_key.h"

namespace kiln::serve {

bool bearer_matches(std::string_view authorization, std::string_view key) {
  constexpr std::string_view scheme = "Bearer ";
  if (authorization.substr(0, scheme.size()) != scheme) return false;
  const std::string_view given = authorization.substr(scheme.size());
  // Every byte of the key is looked at, whatever was given; volatile keeps the compiler
  // from ending the loop at the first difference.
  volatile unsigned char difference = given.size() == key.size() ? 0 : 1;
  for (size_t i = 0; i < key.size(); ++i)
    difference = difference | static_cast<unsigned char>(key[i] ^ (i < given.size() ? given[i] : ~key[i]));
  return !key.empty() && difference == 0;
}

}  // namespace kiln::serve

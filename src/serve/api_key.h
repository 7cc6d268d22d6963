// `kiln serve --api-key KEY`: every endpoint but /health asks for "Authorization: Bearer
// KEY", the OpenAI convention (OpenAI clients send it from their api_key setting).
#pragma once

#include <string_view>

namespace kiln::serve {

// True when `authorization` (the header's value) is the scheme "Bearer" (in any case, as
// RFC 7235 has it), one or more spaces and `key`. The key is compared in constant time:
// how long the comparison takes depends on the key's length only, never on how many of
// its leading characters a guess got right.
bool bearer_matches(std::string_view authorization, std::string_view key);

}  // namespace kiln::serve

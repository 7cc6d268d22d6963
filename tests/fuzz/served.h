// The serve targets' refusal rule: a request the API refuses must be refused as a client
// error (an ApiError of status 4xx); a one-line kiln::Error is a refusal as everywhere
// (fuzz_target.h). Shared by completion_request and request_numbers.
#pragma once

#include "fuzz_target.h"
#include "serve/completion_api.h"

namespace kiln::fuzz {

// True when fn returned; false when it was refused.
template <typename Fn>
bool served(Fn&& fn) {
  bool refused = false;
  const bool returned = accepts([&] {
    try {
      fn();
    } catch (const serve::ApiError& e) {
      KILN_FUZZ_CHECK(e.status >= 400 && e.status < 500, "an ApiError that is not a client error");
      refused = true;
    }
  });
  return returned && !refused;
}

}  // namespace kiln::fuzz

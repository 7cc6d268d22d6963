// The periodic actions' cadence keys: each action runs every N steps (its *_every key) or
// each time the tokens trained cross a multiple of N (its *_every_tokens key), one or the
// other (train/action_schedule.h runs them).
#pragma once

#include "config/config.h"

#include <array>
#include <cstdint>

namespace kiln {

// One action's pair of keys, by name and place in a Config.
struct CadenceKeys {
  const char* steps_key;
  const char* tokens_key;
  int64_t& (*steps)(Config&);
  int64_t& (*tokens)(Config&);
};

const std::array<CadenceKeys, 6>& cadence_keys();

// A tokens key > 0 whose steps key the user did not choose (Config::chosen): the steps
// key's default gives way (0), as data.path's does to data.sources.
void give_way_to_token_cadences(Config& config);
// Both keys of a pair > 0: refused naming both.
void validate_cadences(const Config& config);

}  // namespace kiln

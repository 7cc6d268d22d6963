#include "config/cadence_keys.h"

#include "core/error.h"

namespace kiln {

const std::array<CadenceKeys, 6>& cadence_keys() {
  static const std::array<CadenceKeys, 6> keys{{
      {"log.every", "log.every_tokens", [](Config& c) -> int64_t& { return c.log.every; },
       [](Config& c) -> int64_t& { return c.log.every_tokens; }},
      {"train.eval_every", "train.eval_every_tokens", [](Config& c) -> int64_t& { return c.train.eval_every; },
       [](Config& c) -> int64_t& { return c.train.eval_every_tokens; }},
      {"train.sample_every", "train.sample_every_tokens", [](Config& c) -> int64_t& { return c.train.sample_every; },
       [](Config& c) -> int64_t& { return c.train.sample_every_tokens; }},
      {"eval.every", "eval.every_tokens", [](Config& c) -> int64_t& { return c.eval.every; },
       [](Config& c) -> int64_t& { return c.eval.every_tokens; }},
      {"checkpoint.every", "checkpoint.every_tokens", [](Config& c) -> int64_t& { return c.checkpoint.every; },
       [](Config& c) -> int64_t& { return c.checkpoint.every_tokens; }},
      {"checkpoint.export_hf_every", "checkpoint.export_hf_every_tokens",
       [](Config& c) -> int64_t& { return c.checkpoint.export_hf_every; },
       [](Config& c) -> int64_t& { return c.checkpoint.export_hf_every_tokens; }},
  }};
  return keys;
}

void give_way_to_token_cadences(Config& config) {
  for (const CadenceKeys& k : cadence_keys())
    if (k.tokens(config) > 0 && !config.was_chosen(k.steps_key)) k.steps(config) = 0;
}

void validate_cadences(const Config& config) {
  Config& c = const_cast<Config&>(config);  // the accessors serve both; nothing is written here
  for (const CadenceKeys& k : cadence_keys()) {
    KILN_CHECK(k.steps(c) == 0 || k.tokens(c) == 0, "config",
               "{} ({}) and {} ({}) are mutually exclusive: an action runs by steps or by tokens; set one of them to 0",
               k.steps_key, k.steps(c), k.tokens_key, k.tokens(c));
  }
  // The log needs a cadence: the progress line and metrics.jsonl's records come from it.
  KILN_CHECK(config.log.every > 0 || config.log.every_tokens > 0, "config",
             "log.every must be > 0, got {} (0 only with log.every_tokens)", config.log.every);
}

}  // namespace kiln

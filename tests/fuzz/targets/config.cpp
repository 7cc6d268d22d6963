// Fuzz target: load_config, the TOML config of every run, with --set overrides. Input: the
// TOML file, then (after each NUL) one "section.key=value" override. A config that loads
// must survive what every run does with it: config_to_toml() is saved as the run's
// config.toml and read back by --resume, sample, export and serve, so it must load again
// and give the same values.
#include "../fuzz_target.h"

#include "config/config.h"
#include "config/config_fields.h"

KILN_FUZZ_TARGET(config) {
  using namespace kiln;
  const std::string path = fuzz::scratch_file("config.toml", fuzz::part(input, 0));
  std::vector<std::string> overrides;
  for (size_t i = 1; i <= 16; ++i)
    if (const std::string_view o = fuzz::part(input, i); !o.empty()) overrides.emplace_back(o);
  Config config;
  if (!fuzz::accepts([&] { config = load_config(path, overrides); })) return;
  const std::string saved = fuzz::scratch_file("saved.toml", config_to_toml(config));
  Config back;
  if (!fuzz::accepts([&] { back = load_config(saved); })) fuzz::bug("the saved config.toml does not load again");
  KILN_FUZZ_CHECK(config_equal(config, back), "the saved config.toml reads back different values");
}

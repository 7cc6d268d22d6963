// `kiln config CONFIG [--set ...]`: the resolved configuration a run of CONFIG would use,
// every key with its one-line description, without training. Checked as `kiln train`
// checks it, so a bad key or value is the same one-line error.
#include "cli/commands.h"
#include "config/config.h"
#include "data/shards/shard_tokenizer.h"

#include <fmt/format.h>

namespace kiln::cli {

void add_config_command(CLI::App& app) {
  struct Options {
    std::string config;
    std::vector<std::string> overrides;
  };
  auto o = std::make_shared<Options>();
  CLI::App* cmd = app.add_subcommand("config", "print the resolved config (every key, described) without training");
  cmd->add_option("config", o->config, "TOML config file (e.g. configs/default.toml)")->required();
  cmd->add_option("--set", o->overrides, "override a key: --set model.layers=8 (repeatable)")
      ->take_all()
      ->allow_extra_args(false);
  cmd->callback([o] {
    Config config = load_config(o->config, o->overrides);
    adopt_shard_tokenizer(config);  // as kiln train resolves it
    fmt::print("{}", config_to_toml(config));
  });
}

}  // namespace kiln::cli

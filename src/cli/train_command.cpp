#include "cli/commands.h"
#include "train/trainer.h"

namespace kiln::cli {

void add_train_command(CLI::App& app) {
  struct Options {
    std::string config;
    std::vector<std::string> overrides;
  };
  auto options = std::make_shared<Options>();
  CLI::App* cmd = app.add_subcommand("train", "train a model from a TOML config");
  cmd->add_option("config", options->config, "TOML config file (e.g. configs/default.toml)")->required();
  cmd->add_option("--set", options->overrides, "override a key: --set model.layers=8 (repeatable)")
      ->take_all()
      ->allow_extra_args(false);
  cmd->callback([options] {
    const Config config = load_config(options->config, options->overrides);
    Trainer trainer(config);
    trainer.run();
  });
}

}  // namespace kiln::cli

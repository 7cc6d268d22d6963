#include "cli/commands.h"
#include "core/error.h"
#include "train/trainer.h"

namespace kiln::cli {

void add_train_command(CLI::App& app) {
  struct Options {
    std::string config;
    std::vector<std::string> overrides;
    std::string resume;
    bool allow_data_change = false;
    bool overwrite = false;
  };
  auto options = std::make_shared<Options>();
  CLI::App* cmd = app.add_subcommand("train", "train a model from a TOML config");
  cmd->add_option("config", options->config, "TOML config file (e.g. configs/default.toml)")->required();
  cmd->add_option("--set", options->overrides, "override a key: --set model.layers=8 (repeatable)")
      ->take_all()
      ->allow_extra_args(false);
  CLI::Option* resume =
      cmd->add_option("--resume", options->resume,
                      "continue from the latest checkpoint in checkpoint.dir (none yet: start fresh), or from "
                      "PATH (a checkpoint, or a directory of them)")
          ->expected(0, 1);
  cmd->add_flag("--allow-data-change", options->allow_data_change,
                "resume although the training data changed (the new data is read from its start)");
  cmd->add_flag("--overwrite", options->overwrite,
                "start afresh in a train.out_dir that holds an earlier run, removing that run's files");
  cmd->callback([options, resume] {
    KILN_CHECK(!options->overwrite || resume->count() == 0, "train",
               "--overwrite starts afresh and --resume continues a run: pass one of them");
    const Config config = load_config(options->config, options->overrides);
    TrainOptions train;
    if (resume->count() > 0) train.resume = options->resume.empty() ? "latest" : options->resume;
    train.allow_data_change = options->allow_data_change;
    train.overwrite = options->overwrite;
    Trainer trainer(config, train);
    trainer.run();
  });
}

}  // namespace kiln::cli
